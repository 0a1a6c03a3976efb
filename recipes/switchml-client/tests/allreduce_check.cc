// End-to-end check of an installed switchml-client with the dummy backend.
// With general.num_workers = N in ./switchml.cfg, the dummy backend plays the other N-1 workers,
// so an allreduce SUM must return N x the input. Unlike upstream's hello_world (which only fails
// when the result is too small), this checks both directions, for float32 and int32, and that the
// input buffer is left untouched. Exit status 0 = every element within 1% (floats) or exact (ints).
#include <switchml/context.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <vector>

namespace {

constexpr uint64_t kNumel = 1 << 16;

bool CheckFloat(switchml::Context& ctx, int workers) {
    std::vector<float> in(kNumel), out(kNumel, 0.0f);
    for (uint64_t i = 0; i < kNumel; i++) in[i] = 0.5f + static_cast<float>(i % 1000);
    const std::vector<float> original = in;
    auto job = ctx.AllReduce(in.data(), out.data(), kNumel, switchml::FLOAT32, switchml::AllReduceOperation::SUM);
    if (job->GetJobStatus() != switchml::JobStatus::FINISHED) {
        std::printf("float32: job did not finish (status %d)\n", static_cast<int>(job->GetJobStatus()));
        return false;
    }
    for (uint64_t i = 0; i < kNumel; i++) {
        const float expected = original[i] * workers;
        if (std::fabs(out[i] - expected) > 0.01f * std::fabs(expected) || in[i] != original[i]) {
            std::printf("float32: element %lu is %g (input now %g), expected %g\n",
                        static_cast<unsigned long>(i), out[i], in[i], expected);
            return false;
        }
    }
    std::printf("float32: in[7]=%g out[7]=%g ratio=%.4f over %lu elements\n",
                original[7], out[7], out[7] / original[7], static_cast<unsigned long>(kNumel));
    return true;
}

bool CheckInt(switchml::Context& ctx, int workers) {
    std::vector<int32_t> in(kNumel), out(kNumel, 0);
    for (uint64_t i = 0; i < kNumel; i++) in[i] = static_cast<int32_t>(i % 4096) - 2048;
    const std::vector<int32_t> original = in;
    auto job = ctx.AllReduce(in.data(), out.data(), kNumel, switchml::INT32, switchml::AllReduceOperation::SUM);
    if (job->GetJobStatus() != switchml::JobStatus::FINISHED) {
        std::printf("int32: job did not finish (status %d)\n", static_cast<int>(job->GetJobStatus()));
        return false;
    }
    for (uint64_t i = 0; i < kNumel; i++) {
        if (out[i] != original[i] * workers || in[i] != original[i]) {
            std::printf("int32: element %lu is %d (input now %d), expected %d\n",
                        static_cast<unsigned long>(i), out[i], in[i], original[i] * workers);
            return false;
        }
    }
    std::printf("int32: in[7]=%d out[7]=%d over %lu elements\n", original[7], out[7],
                static_cast<unsigned long>(kNumel));
    return true;
}

}  // namespace

int main() {
    switchml::Context& ctx = switchml::Context::GetInstance();
    if (!ctx.Start()) {
        std::printf("the SwitchML context did not start\n");
        return 2;
    }
    const int workers = ctx.GetConfig().general_.num_workers;
    std::printf("num_workers=%d backend=%s\n", workers, ctx.GetConfig().general_.backend.c_str());
    const bool ok = CheckFloat(ctx, workers) && CheckInt(ctx, workers);
    ctx.Stop();
    std::printf(ok ? "allreduce_check: PASS\n" : "allreduce_check: FAIL\n");
    return ok ? 0 : 1;
}

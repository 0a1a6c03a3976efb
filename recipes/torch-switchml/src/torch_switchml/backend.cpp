// torch_switchml._C: a c10d backend for a stock PyTorch 2.x whose allreduce runs on SwitchML.
//
// SwitchML aggregates the SUM of one dense float32 or int32 tensor per process; that is the only
// operation it takes. Everything else (other ops, dtypes, several tensors, and every call while no
// switchml.cfg is found) goes to a gloo backend that the Python side creates for the same group and
// hands in, so a group on "switchml" supports every collective gloo does.
//
// SwitchML's context is one per process and can be started and stopped once. Every backend object
// that uses it holds a reference: the first starts it, the last one waits for all jobs and stops it.

#include <torch/extension.h>

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <switchml/context.h>

#include <unistd.h>

#include <climits>
#include <fstream>
#include <mutex>
#include <set>
#include <string>
#include <vector>

namespace torch_switchml {
namespace {

std::mutex contextMutex;
std::set<const void*> contextUsers;

// The files SwitchML's Config::LoadFromFile() reads, in its order. Start() aborts the process when
// none exists, so look before starting.
std::string findConfig() {
  std::vector<std::string> paths = {"/etc/switchml.cfg", "switchml.cfg"};
  char hostname[HOST_NAME_MAX + 1] = {};
  if (gethostname(hostname, HOST_NAME_MAX) == 0) {
    paths.push_back(std::string("switchml-") + hostname + ".cfg");
  }
  for (const auto& path : paths) {
    if (std::ifstream(path).good()) {
      return path;
    }
  }
  return "";
}

// Takes a reference on the context for `user`, starting it for the first user. False means the
// user runs everything on gloo: no configuration, or the context already ran and was stopped.
bool acquireContext(const void* user) {
  std::lock_guard<std::mutex> lock(contextMutex);
  if (contextUsers.empty()) {
    auto& context = switchml::Context::GetInstance();
    if (findConfig().empty()) {
      TORCH_WARN(
          "SwitchML: no configuration file (/etc/switchml.cfg, ./switchml.cfg or ",
          "./switchml-<hostname>.cfg); this process group runs every collective on gloo.");
      return false;
    }
    if (context.GetContextState() != switchml::Context::ContextState::CREATED ||
        !context.Start()) {
      TORCH_WARN(
          "SwitchML: the context cannot be started again in this process; ",
          "this process group runs every collective on gloo.");
      return false;
    }
  }
  contextUsers.insert(user);
  return true;
}

void releaseContext(const void* user) {
  std::lock_guard<std::mutex> lock(contextMutex);
  if (contextUsers.erase(user) == 1 && contextUsers.empty()) {
    auto& context = switchml::Context::GetInstance();
    context.WaitForAllJobs();
    context.Stop();
  }
}

// A collective that already ran: SwitchML's AllReduce returns when the job is done.
class CompletedWork : public c10d::Work {
 public:
  CompletedWork(int rank, std::vector<at::Tensor> tensors)
      : c10d::Work(rank, c10d::OpType::ALLREDUCE, "switchml:all_reduce"),
        future_(c10::make_intrusive<c10::ivalue::Future>(
            c10::ListType::create(c10::TensorType::get()))) {
    future_->markCompleted(c10::IValue(std::move(tensors)));
  }

  bool isCompleted() override {
    return true;
  }

  bool isSuccess() const override {
    return true;
  }

  bool wait(std::chrono::milliseconds /* timeout */) override {
    return true;
  }

  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    return future_;
  }

 private:
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

class SwitchMLBackend : public c10d::Backend {
 public:
  SwitchMLBackend(int rank, int size, c10::intrusive_ptr<c10d::Backend> gloo)
      : c10d::Backend(rank, size), gloo_(std::move(gloo)), active_(acquireContext(this)) {}

  ~SwitchMLBackend() override {
    if (active_) {
      releaseContext(this);
    }
  }

  const std::string getBackendName() const override {
    return "switchml";
  }

  bool usesSwitchML() const {
    return active_;
  }

  c10::intrusive_ptr<c10d::Work> allreduce(
      std::vector<at::Tensor>& tensors,
      const c10d::AllreduceOptions& opts) override {
    if (!eligible(tensors, opts)) {
      return gloo_->allreduce(tensors, opts);
    }
    at::Tensor& tensor = tensors[0];
    // SwitchML works on host memory: CUDA tensors make a round trip through a host copy.
    at::Tensor host = tensor.is_cuda() ? tensor.to(at::kCPU) : tensor;
    const auto dataType = host.scalar_type() == at::kFloat ? switchml::DataType::FLOAT32
                                                           : switchml::DataType::INT32;
    auto job = switchml::Context::GetInstance().AllReduce(
        host.data_ptr(), host.data_ptr(), host.numel(), dataType,
        switchml::AllReduceOperation::SUM);
    TORCH_CHECK(
        job->GetJobStatus() == switchml::JobStatus::FINISHED,
        "SwitchML allreduce did not finish (job status ",
        static_cast<int>(job->GetJobStatus()),
        ")");
    if (tensor.is_cuda()) {
      tensor.copy_(host);
    }
    return c10::make_intrusive<CompletedWork>(getRank(), tensors);
  }

  // Everything SwitchML does not aggregate runs on gloo.
  c10::intrusive_ptr<c10d::Work> broadcast(
      std::vector<at::Tensor>& tensors,
      const c10d::BroadcastOptions& opts) override {
    return gloo_->broadcast(tensors, opts);
  }

  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors,
      const c10d::AllreduceCoalescedOptions& opts) override {
    return gloo_->allreduce_coalesced(tensors, opts);
  }

  c10::intrusive_ptr<c10d::Work> reduce(
      std::vector<at::Tensor>& tensors,
      const c10d::ReduceOptions& opts) override {
    return gloo_->reduce(tensors, opts);
  }

  c10::intrusive_ptr<c10d::Work> allgather(
      std::vector<std::vector<at::Tensor>>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override {
    return gloo_->allgather(outputs, inputs, opts);
  }

  c10::intrusive_ptr<c10d::Work> _allgather_base(
      at::Tensor& output,
      at::Tensor& input,
      const c10d::AllgatherOptions& opts) override {
    return gloo_->_allgather_base(output, input, opts);
  }

  c10::intrusive_ptr<c10d::Work> allgather_coalesced(
      std::vector<std::vector<at::Tensor>>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override {
    return gloo_->allgather_coalesced(outputs, inputs, opts);
  }

  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(
      std::vector<at::Tensor>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override {
    return gloo_->allgather_into_tensor_coalesced(outputs, inputs, opts);
  }

  c10::intrusive_ptr<c10d::Work> gather(
      std::vector<std::vector<at::Tensor>>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::GatherOptions& opts) override {
    return gloo_->gather(outputs, inputs, opts);
  }

  c10::intrusive_ptr<c10d::Work> scatter(
      std::vector<at::Tensor>& outputs,
      std::vector<std::vector<at::Tensor>>& inputs,
      const c10d::ScatterOptions& opts) override {
    return gloo_->scatter(outputs, inputs, opts);
  }

  c10::intrusive_ptr<c10d::Work> reduce_scatter(
      std::vector<at::Tensor>& outputs,
      std::vector<std::vector<at::Tensor>>& inputs,
      const c10d::ReduceScatterOptions& opts) override {
    return gloo_->reduce_scatter(outputs, inputs, opts);
  }

  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& output,
      at::Tensor& input,
      const c10d::ReduceScatterOptions& opts) override {
    return gloo_->_reduce_scatter_base(output, input, opts);
  }

  c10::intrusive_ptr<c10d::Work> alltoall_base(
      at::Tensor& output,
      at::Tensor& input,
      std::vector<int64_t>& outputSplitSizes,
      std::vector<int64_t>& inputSplitSizes,
      const c10d::AllToAllOptions& opts) override {
    return gloo_->alltoall_base(output, input, outputSplitSizes, inputSplitSizes, opts);
  }

  c10::intrusive_ptr<c10d::Work> alltoall(
      std::vector<at::Tensor>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::AllToAllOptions& opts) override {
    return gloo_->alltoall(outputs, inputs, opts);
  }

  c10::intrusive_ptr<c10d::Work> send(
      std::vector<at::Tensor>& tensors,
      int dstRank,
      int tag) override {
    return gloo_->send(tensors, dstRank, tag);
  }

  c10::intrusive_ptr<c10d::Work> recv(
      std::vector<at::Tensor>& tensors,
      int srcRank,
      int tag) override {
    return gloo_->recv(tensors, srcRank, tag);
  }

  c10::intrusive_ptr<c10d::Work> recvAnysource(
      std::vector<at::Tensor>& tensors,
      int tag) override {
    return gloo_->recvAnysource(tensors, tag);
  }

  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override {
    return gloo_->barrier(opts);
  }

 private:
  // SwitchML takes the SUM of one dense float32/int32 tensor per process.
  bool eligible(const std::vector<at::Tensor>& tensors, const c10d::AllreduceOptions& opts) const {
    if (!active_ || tensors.size() != 1 || opts.reduceOp != c10d::ReduceOp::SUM) {
      return false;
    }
    const at::Tensor& tensor = tensors[0];
    const auto type = tensor.scalar_type();
    return tensor.layout() == at::kStrided && tensor.is_contiguous() &&
        (type == at::kFloat || type == at::kInt);
  }

  c10::intrusive_ptr<c10d::Backend> gloo_;
  const bool active_;
};

} // namespace
} // namespace torch_switchml

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "SwitchML c10d backend (see torch_switchml/__init__.py)";
  m.def(
      "create_backend",
      [](c10::intrusive_ptr<c10d::Backend> gloo, int rank, int size) {
        return c10::intrusive_ptr<c10d::Backend>(
            c10::make_intrusive<torch_switchml::SwitchMLBackend>(rank, size, std::move(gloo)));
      },
      py::arg("gloo"),
      py::arg("rank"),
      py::arg("size"),
      "A switchml backend for one group; `gloo` runs what SwitchML does not.");
  m.def(
      "uses_switchml",
      [](c10::intrusive_ptr<c10d::Backend> backend) {
        auto* switchml = dynamic_cast<torch_switchml::SwitchMLBackend*>(backend.get());
        return switchml != nullptr && switchml->usesSwitchML();
      },
      py::arg("backend"),
      "Whether `backend` is a switchml backend holding the SwitchML context (else all is gloo).");
  m.def(
      "config_file",
      &torch_switchml::findConfig,
      "The switchml.cfg SwitchML would read from here, or an empty string.");
}

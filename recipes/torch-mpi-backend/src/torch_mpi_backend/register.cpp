// torch_mpi_backend._C: hands PyTorch's own ProcessGroupMPI (compiled next to this file from the
// release's ProcessGroupMPI.cpp) to torch.distributed as a plug-in backend, with the two flat-tensor
// collectives it lacks built from its own.
//
// torch.distributed calls the creator only on the members of a group. ProcessGroupMPI's own
// createProcessGroupMPI(ranks) builds a sub-communicator with MPI_Comm_create over MPI_COMM_WORLD,
// which every world rank must enter; the built-in "mpi" backend arranges that, a plug-in cannot.
// So subgroups are built here with MPI_Comm_create_group, which only the members enter.
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/distributed/c10d/ProcessGroupMPI.hpp>
#include <torch/extension.h>
#include <torch/version.h>

#include <chrono>
#include <cstdlib>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

// PyTorch 2.14 renamed three Backend collectives to the torchcomms names and kept the old names only
// as forwarding aliases (Backend.hpp of 2.14.1 and 2.15.0); ProcessGroupMPI declares the new ones. The
// overrides below must carry the names torch.distributed calls, or PyTorch's own implementation would
// run without the queued-work wait and the checked composition of this subclass.
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 14)
#define CUDAMPI_ALL_GATHER_SINGLE all_gather_single
#define CUDAMPI_REDUCE_SCATTER_SINGLE reduce_scatter_single
#define CUDAMPI_ALL_TO_ALL_SINGLE all_to_all_single
#else
#define CUDAMPI_ALL_GATHER_SINGLE _allgather_base
#define CUDAMPI_REDUCE_SCATTER_SINGLE _reduce_scatter_base
#define CUDAMPI_ALL_TO_ALL_SINGLE alltoall_base
#endif

namespace {

constexpr int kCreateGroupTag = 0x7c1d;

void check(int status, const char* call) {
  TORCH_CHECK(
      status == MPI_SUCCESS,
      "cudampi: ",
      call,
      " failed with MPI error code ",
      status);
}

// CUDA kernels run asynchronously on the device's current stream, but ProcessGroupMPI hands a CUDA
// tensor's device pointer to a CUDA-aware MPI at once, from its worker thread: MPI then reads inputs
// that the kernels producing them have not written yet, and kernels still queued on the stream
// (a fill of the output, say) overwrite what MPI wrote. Measured on one H100 with MPICH 4.3.2: 22 of
// 73 correctness cases wrong. So every collective first waits for the work queued on the current
// stream of each CUDA tensor's device, as NCCL's process group orders its stream after that one.
// Where no CUDA device exists there is no queued work either, and ProcessGroupMPI's own tensor check
// then decides (it refuses CUDA tensors unless MPI is CUDA-aware).
void waitForQueuedWork(const std::vector<at::Tensor>& tensors) {
  for (const auto& tensor : tensors) {
    if (tensor.is_cuda()) {
      const auto* impl = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
      if (impl->deviceCount() > 0) {
        impl->synchronizeStream(impl->getStream(tensor.device()));
      }
    }
  }
}

void waitForQueuedWork(const std::vector<std::vector<at::Tensor>>& lists) {
  for (const auto& tensors : lists) {
    waitForQueuedWork(tensors);
  }
}

// Which all_reduce calls cudampi composes from MPI's all-to-all and all-gather instead of handing
// them to MPI_Allreduce (CUDAMPI_COMPOSED, read when a group is created). MPICH 4.3.2 with CUDA
// runs MPI_Allreduce of device buffers over 1 MiB through its shared-memory release/gather
// algorithm, 8 KiB at a time, each piece reduced by a yaksa call costing about 0.3 ms: 0.03 GB/s.
// Its all-to-all and all-gather of device buffers reach 100+ GB/s through GPU IPC on one node, and
// no MPICH variable made MPI_Allreduce itself faster than 2 GB/s (docs/records/2026-11-25-cudampi-one-h100.md, "Why
// MPICH's CUDA all_reduce and broadcast are slow"). Broadcast is MPI_Bcast for every tensor: with
// MPIR_CVAR_BCAST_POSIX_INTRA_ALGORITHM=mpir (the gpu-cluster site sets it) it takes GPU IPC.
//
// CUDAMPI_COMPOSED=auto chooses per call, by size: a CUDA tensor of more than CUDAMPI_COMPOSED_ABOVE
// bytes is composed, a smaller one goes to MPI_Allreduce on device memory (issue 57: where MPICH's
// own call is fast, the composition's fixed cost is ours alone). Not the default until measured.
enum class Composition { Cuda, All, None, Auto };

Composition compositionFromEnv() {
  const char* value = std::getenv("CUDAMPI_COMPOSED");
  const std::string text = value == nullptr ? "cuda" : value;
  if (text == "cuda" || text.empty()) {
    return Composition::Cuda;
  }
  if (text == "all") {
    return Composition::All;
  }
  if (text == "none") {
    return Composition::None;
  }
  if (text == "auto") {
    return Composition::Auto;
  }
  TORCH_CHECK(
      false,
      "cudampi: CUDAMPI_COMPOSED=",
      text,
      " is not one of cuda (compose all_reduce of CUDA tensors, the default), "
      "all (CPU tensors too), none (MPI_Allreduce for every tensor) or auto (compose CUDA "
      "tensors of more than CUDAMPI_COMPOSED_ABOVE bytes)");
}

std::string compositionName(Composition composition) {
  switch (composition) {
    case Composition::Cuda:
      return "cuda";
    case Composition::All:
      return "all";
    case Composition::Auto:
      return "auto";
    default:
      return "none";
  }
}

// CUDAMPI_COMPOSED_ABOVE: with CUDAMPI_COMPOSED=auto, the largest CUDA all_reduce (bytes) left to
// MPI_Allreduce; a count with an optional K, M or G (powers of 1024). Read, and checked, when a group
// is created whatever the mode, so that a misspelt value never passes silently. The default, 0, composes
// every CUDA all_reduce (auto is then cuda): on two H100s MPICH 4.3.2's MPI_Allreduce on device memory took
// 4.6-5.6 ms at 1 MiB against the composition's 0.27-0.42 ms, and lost at every size measured (issue 57,
// docs/howto/mpi-without-a-rebuild.md); a site whose MPI is fast on small device buffers sets its own threshold.
constexpr int64_t kDefaultComposedAbove = 0;

int64_t composedAboveFromEnv() {
  const char* value = std::getenv("CUDAMPI_COMPOSED_ABOVE");
  if (value == nullptr || *value == '\0') {
    return kDefaultComposedAbove;
  }
  const std::string text = value;
  size_t digits = 0;
  while (digits < text.size() && text[digits] >= '0' && text[digits] <= '9') {
    ++digits;
  }
  int shift = -1;
  if (digits > 0 && digits <= 12) {
    const std::string suffix = text.substr(digits);
    if (suffix.empty()) {
      shift = 0;
    } else if (suffix == "K" || suffix == "k") {
      shift = 10;
    } else if (suffix == "M" || suffix == "m") {
      shift = 20;
    } else if (suffix == "G" || suffix == "g") {
      shift = 30;
    }
  }
  TORCH_CHECK(
      shift >= 0,
      "cudampi: CUDAMPI_COMPOSED_ABOVE=",
      text,
      " is not a byte count (digits with an optional K, M or G, e.g. 1M or 4194304)");
  return std::stoll(text.substr(0, digits)) << shift;
}

// CUDAMPI_PROFILE=1: every all_reduce of a group created with it records the wall time of each of
// its phases (issue 57: where the fixed cost of a call goes). Read once per group into one bool, so
// with it off (unset, empty or 0) a call pays one branch. torch_mpi_backend.profile_records() returns
// the records, profile_reset() drops them.
bool profileFromEnv() {
  const char* value = std::getenv("CUDAMPI_PROFILE");
  const std::string text = value == nullptr ? "" : value;
  if (text.empty() || text == "0") {
    return false;
  }
  TORCH_CHECK(
      text == "1",
      "cudampi: CUDAMPI_PROFILE=",
      text,
      " is not 0 (off, the default) or 1 (record the phases of every all_reduce)");
  return true;
}

using Clock = std::chrono::steady_clock;

double secondsBetween(Clock::time_point from, Clock::time_point to) {
  return std::chrono::duration<double>(to - from).count();
}

// One phase of a profiled call: when it started (seconds after the call entered the backend), its
// host wall time, and for a step that queued CUDA kernels, the device time between two CUDA events
// recorded on the stream around them (resolved when the call ends, so no phase waits for its own).
struct Phase {
  std::string name;
  double startSeconds = 0.0;
  double wallSeconds = 0.0;
  void* beginEvent = nullptr;
  void* endEvent = nullptr;
  c10::DeviceIndex deviceIndex = -1;
  double deviceSeconds = -1.0;
};

struct CallRecord {
  std::string path; // "composed" or "mpi_allreduce"
  std::string device;
  int64_t bytes = 0;
  int ranks = 0;
  Clock::time_point entered;
  // When the worker thread last finished a step of ours: a step PyTorch's own entry runs (its
  // MPI_Alltoall or MPI_Allreduce) is timed as the gap up to the next step of ours, so it includes
  // the worker's hand-off between the two entries.
  Clock::time_point lastStepEnd;
  double totalSeconds = 0.0;
  std::vector<Phase> phases;
};

std::mutex profileMutex;
std::vector<CallRecord> profileRecords;

// Runs step() as the phase `name` of record (when profiling; otherwise just runs it). Where kernelsOn
// is a CUDA tensor, CUDA events on its device's current stream bracket the kernels step() queues.
template <typename Step>
void timedPhase(
    const std::shared_ptr<CallRecord>& record,
    const char* name,
    const at::Tensor* kernelsOn,
    Step&& step) {
  if (!record) {
    step();
    return;
  }
  Phase phase;
  phase.name = name;
  const c10::impl::DeviceGuardImplInterface* impl = nullptr;
  std::optional<c10::Stream> stream;
  if (kernelsOn != nullptr && kernelsOn->is_cuda()) {
    impl = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
    phase.deviceIndex = kernelsOn->device().index();
    stream = impl->getStream(kernelsOn->device());
    impl->record(&phase.beginEvent, *stream, phase.deviceIndex, c10::EventFlag::BACKEND_DEFAULT);
  }
  const auto start = Clock::now();
  step();
  const auto stop = Clock::now();
  if (impl != nullptr) {
    impl->record(&phase.endEvent, *stream, phase.deviceIndex, c10::EventFlag::BACKEND_DEFAULT);
  }
  phase.startSeconds = secondsBetween(record->entered, start);
  phase.wallSeconds = secondsBetween(start, stop);
  record->phases.push_back(std::move(phase));
  record->lastStepEnd = Clock::now();
}

// A phase run by an entry that is not ours, timed from the end of our last step to now.
void gapPhase(const std::shared_ptr<CallRecord>& record, const char* name) {
  if (!record) {
    return;
  }
  const auto now = Clock::now();
  Phase phase;
  phase.name = name;
  phase.startSeconds = secondsBetween(record->entered, record->lastStepEnd);
  phase.wallSeconds = secondsBetween(record->lastStepEnd, now);
  record->phases.push_back(std::move(phase));
  record->lastStepEnd = now;
}

// The call's last step has run: resolve the CUDA events (every kernel has finished, the step that
// queued the last of them synchronized its stream) and keep the record.
void finishRecord(const std::shared_ptr<CallRecord>& record) {
  if (!record) {
    return;
  }
  record->totalSeconds = secondsBetween(record->entered, Clock::now());
  for (auto& phase : record->phases) {
    if (phase.beginEvent != nullptr && phase.endEvent != nullptr) {
      const auto* impl = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
      impl->synchronizeEvent(phase.endEvent);
      phase.deviceSeconds = impl->elapsedTime(phase.beginEvent, phase.endEvent, phase.deviceIndex) / 1e3;
      impl->destroyEvent(phase.beginEvent, phase.deviceIndex);
      impl->destroyEvent(phase.endEvent, phase.deviceIndex);
      phase.beginEvent = phase.endEvent = nullptr;
    }
  }
  std::lock_guard<std::mutex> lock(profileMutex);
  profileRecords.push_back(*record);
}

// The dtypes PyTorch's ProcessGroupMPI maps to MPI datatypes; anything else goes to its own path,
// which raises its own error.
bool mpiMovesDtype(at::ScalarType type) {
  switch (type) {
    case at::kByte:
    case at::kChar:
    case at::kShort:
    case at::kInt:
    case at::kLong:
    case at::kFloat:
    case at::kDouble:
      return true;
    default:
      return false;
  }
}

// The reduction of the blocks every rank sent this one (row r of blocks is rank r's block), written
// straight into out: one kernel, no temporary. Kept in the tensor's dtype, as MPI_SUM/MPI_PROD keep
// it (small integer types would promote).
void reduceInto(at::Tensor out, const at::Tensor& blocks, c10d::ReduceOp::RedOpType op) {
  static const int64_t kRows[] = {0};
  switch (op) {
    case c10d::ReduceOp::SUM:
      at::sum_out(out, blocks, at::IntArrayRef(kRows), false, blocks.scalar_type());
      break;
    case c10d::ReduceOp::PRODUCT:
      at::prod_out(out, blocks, 0, false, blocks.scalar_type());
      break;
    case c10d::ReduceOp::MIN:
      at::amin_out(out, blocks, at::IntArrayRef(kRows), false);
      break;
    default:
      at::amax_out(out, blocks, at::IntArrayRef(kRows), false);
      break;
  }
}

// PyTorch's ProcessGroupMPI plus the two flat-tensor collectives it lacks
// ("no support for _allgather_base", "does not support _reduce_scatter_base"),
// which all_gather_into_tensor and reduce_scatter_tensor (FSDP, torch_dist_check)
// need. Both are built from PyTorch's own checked collectives, so the tensor
// checks, the CUDA-aware decision and the worker thread stay PyTorch's.
class ProcessGroupCudaMPI final : public c10d::ProcessGroupMPI {
 public:
  using c10d::ProcessGroupMPI::ProcessGroupMPI;

  // The group of every process: starts MPI once (MPI_THREAD_SERIALIZED), as
  // ProcessGroupMPI::createProcessGroupMPI({}) does.
  static c10::intrusive_ptr<ProcessGroupCudaMPI> createWorld() {
    initMPIOnce();
    int rank = -1;
    int size = -1;
    {
      std::lock_guard<std::mutex> lock(pgGlobalMutex_);
      check(MPI_Comm_rank(MPI_COMM_WORLD, &rank), "MPI_Comm_rank");
      check(MPI_Comm_size(MPI_COMM_WORLD, &size), "MPI_Comm_size");
    }
    return c10::make_intrusive<ProcessGroupCudaMPI>(rank, size, MPI_COMM_WORLD);
  }

  // A group of some ranks: MPI_Comm_create_group, entered by its members only.
  static c10::intrusive_ptr<ProcessGroupCudaMPI> createSubgroup(
      const std::vector<int>& globalRanks) {
    int initialized = 0;
    check(MPI_Initialized(&initialized), "MPI_Initialized");
    // MPI_Init is collective over the whole job: a subgroup alone cannot start MPI.
    TORCH_CHECK(
        initialized,
        "cudampi: a subgroup needs MPI running already; create the default group with "
        "the cudampi backend first (init_process_group(\"cudampi\") or "
        "\"cpu:gloo,cuda:cudampi\")");
    MPI_Comm comm = MPI_COMM_NULL;
    int rank = -1;
    int size = -1;
    {
      // MPI_THREAD_SERIALIZED: no MPI call while a group's worker thread makes one.
      std::lock_guard<std::mutex> lock(pgGlobalMutex_);
      MPI_Group worldGroup = MPI_GROUP_NULL;
      MPI_Group group = MPI_GROUP_NULL;
      check(MPI_Comm_group(MPI_COMM_WORLD, &worldGroup), "MPI_Comm_group");
      check(
          MPI_Group_incl(
              worldGroup,
              static_cast<int>(globalRanks.size()),
              globalRanks.data(),
              &group),
          "MPI_Group_incl");
      check(
          MPI_Comm_create_group(MPI_COMM_WORLD, group, kCreateGroupTag, &comm),
          "MPI_Comm_create_group");
      check(MPI_Group_free(&group), "MPI_Group_free");
      check(MPI_Group_free(&worldGroup), "MPI_Group_free");
      check(MPI_Comm_rank(comm, &rank), "MPI_Comm_rank");
      check(MPI_Comm_size(comm, &size), "MPI_Comm_size");
    }
    return c10::make_intrusive<ProcessGroupCudaMPI>(rank, size, comm);
  }

  // PyTorch's collectives, each after the CUDA work queued on its tensors (see waitForQueuedWork).
  c10::intrusive_ptr<c10d::Work> broadcast(
      std::vector<at::Tensor>& tensors,
      const c10d::BroadcastOptions& opts) override {
    waitForQueuedWork(tensors);
    return ProcessGroupMPI::broadcast(tensors, opts);
  }

  c10::intrusive_ptr<c10d::Work> allreduce(
      std::vector<at::Tensor>& tensors,
      const c10d::AllreduceOptions& opts) override {
    std::shared_ptr<CallRecord> record;
    if (profile_ && tensors.size() == 1) {
      record = std::make_shared<CallRecord>();
      record->entered = Clock::now();
      record->device = tensors[0].device().str();
      record->bytes = static_cast<int64_t>(tensors[0].nbytes());
      record->ranks = getSize();
    }
    timedPhase(record, "wait_queued_work", nullptr, [&] { waitForQueuedWork(tensors); });
    const auto op = opts.reduceOp.op_;
    if (composes(tensors) &&
        (op == c10d::ReduceOp::SUM || op == c10d::ReduceOp::PRODUCT ||
         op == c10d::ReduceOp::MIN || op == c10d::ReduceOp::MAX)) {
      return composedAllreduce(tensors[0], op, record);
    }
    if (record) {
      return profiledMpiAllreduce(tensors, opts, record);
    }
    return ProcessGroupMPI::allreduce(tensors, opts);
  }

  void setComposition(Composition composition, int64_t composedAbove) {
    composition_ = composition;
    composedAbove_ = composedAbove;
  }

  void setProfile(bool profile) {
    profile_ = profile;
  }

  // Wait (at most deadline) until the worker has run everything queued before now, and has dropped
  // those entries: a no-op entry, holding no tensor, goes through the queue and is waited for. Used
  // at the interpreter's exit (drainAll).
  bool drain(Clock::time_point deadline) {
    std::function<void(std::unique_ptr<c10d::WorkEntry>&)> nothing = [](std::unique_ptr<c10d::WorkEntry>&) {};
    auto work = enqueue(std::make_unique<c10d::WorkEntry>(nullptr, nullptr, std::move(nothing)), "mpi:drain");
    while (!work->isCompleted()) {
      if (Clock::now() > deadline) {
        return false;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    return true;
  }

  // torch.distributed.destroy_process_group calls shutdown() on every backend (PyTorch releases with a
  // virtual Backend::shutdown; on 2.6.0, which has none, this is an ordinary method nobody calls). Drain
  // the queue here too: after destroy_process_group the group is out of drainAll's reach at exit, yet its
  // worker could still drop the last collective's tensors during the teardown (a two-rank job ending in
  // destroy_process_group on PyTorch 2.14.1: 4-6 of 25 exits aborted with the atexit drain alone, 0 of 25
  // with a drain before destroy_process_group).
  void shutdown() {
    const auto deadline = Clock::now() + std::chrono::seconds(10);
    if (PyGILState_Check()) {
      pybind11::gil_scoped_release release; // the worker may need the GIL to drop a tensor
      drain(deadline);
    } else {
      drain(deadline);
    }
  }

  Composition composition() const {
    return composition_;
  }

  c10::intrusive_ptr<c10d::Work> reduce(
      std::vector<at::Tensor>& tensors,
      const c10d::ReduceOptions& opts) override {
    waitForQueuedWork(tensors);
    return ProcessGroupMPI::reduce(tensors, opts);
  }

  c10::intrusive_ptr<c10d::Work> allgather(
      std::vector<std::vector<at::Tensor>>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override {
    waitForQueuedWork(inputs);
    waitForQueuedWork(outputs);
    return ProcessGroupMPI::allgather(outputs, inputs, opts);
  }

  c10::intrusive_ptr<c10d::Work> gather(
      std::vector<std::vector<at::Tensor>>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::GatherOptions& opts) override {
    waitForQueuedWork(inputs);
    waitForQueuedWork(outputs);
    return ProcessGroupMPI::gather(outputs, inputs, opts);
  }

  c10::intrusive_ptr<c10d::Work> scatter(
      std::vector<at::Tensor>& outputs,
      std::vector<std::vector<at::Tensor>>& inputs,
      const c10d::ScatterOptions& opts) override {
    waitForQueuedWork(outputs);
    waitForQueuedWork(inputs);
    return ProcessGroupMPI::scatter(outputs, inputs, opts);
  }

  c10::intrusive_ptr<c10d::Work> CUDAMPI_ALL_TO_ALL_SINGLE(
      at::Tensor& output,
      at::Tensor& input,
      std::vector<int64_t>& outputSplits,
      std::vector<int64_t>& inputSplits,
      const c10d::AllToAllOptions& opts) override {
    waitForQueuedWork({output, input});
    return ProcessGroupMPI::CUDAMPI_ALL_TO_ALL_SINGLE(
        output, input, outputSplits, inputSplits, opts);
  }

  c10::intrusive_ptr<c10d::Work> alltoall(
      std::vector<at::Tensor>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::AllToAllOptions& opts) override {
    waitForQueuedWork(outputs);
    waitForQueuedWork(inputs);
    return ProcessGroupMPI::alltoall(outputs, inputs, opts);
  }

  c10::intrusive_ptr<c10d::Work> send(
      std::vector<at::Tensor>& tensors,
      int dstRank,
      int tag) override {
    waitForQueuedWork(tensors);
    return ProcessGroupMPI::send(tensors, dstRank, tag);
  }

  c10::intrusive_ptr<c10d::Work> recv(
      std::vector<at::Tensor>& tensors,
      int srcRank,
      int tag) override {
    waitForQueuedWork(tensors);
    return ProcessGroupMPI::recv(tensors, srcRank, tag);
  }

  c10::intrusive_ptr<c10d::Work> recvAnysource(
      std::vector<at::Tensor>& tensors,
      int tag) override {
    waitForQueuedWork(tensors);
    return ProcessGroupMPI::recvAnysource(tensors, tag);
  }

  // all_gather_into_tensor: PyTorch's allgather, writing into views of output.
  c10::intrusive_ptr<c10d::Work> CUDAMPI_ALL_GATHER_SINGLE(
      at::Tensor& output,
      at::Tensor& input,
      const c10d::AllgatherOptions& opts) override {
    TORCH_CHECK(output.is_contiguous(), "input tensor has to be contiguous");
    const int64_t count = input.numel();
    TORCH_CHECK(
        output.numel() == count * getSize(),
        "cudampi: all_gather_into_tensor needs an output of world size x ",
        count,
        " elements, got ",
        output.numel());
    auto flat = output.view(-1);
    std::vector<std::vector<at::Tensor>> outputs(1);
    for (int peer = 0; peer < getSize(); ++peer) {
      outputs[0].push_back(flat.narrow(0, peer * count, count));
    }
    std::vector<at::Tensor> inputs{input};
    return allgather(outputs, inputs, opts);
  }

  // reduce_scatter_tensor: PyTorch's alltoall sends block j of every rank to
  // rank j (the traffic of a reduce-scatter), then rank j reduces its blocks.
  c10::intrusive_ptr<c10d::Work> CUDAMPI_REDUCE_SCATTER_SINGLE(
      at::Tensor& output,
      at::Tensor& input,
      const c10d::ReduceScatterOptions& opts) override {
    TORCH_CHECK(
        input.is_contiguous() && output.is_contiguous(),
        "input tensor has to be contiguous");
    TORCH_CHECK(
        input.numel() == output.numel() * getSize() &&
            input.scalar_type() == output.scalar_type(),
        "cudampi: reduce_scatter_tensor needs an input of world size x the "
        "output's elements, of the output's dtype");
    const auto op = opts.reduceOp.op_;
    TORCH_CHECK(
        op == c10d::ReduceOp::SUM || op == c10d::ReduceOp::PRODUCT ||
            op == c10d::ReduceOp::MIN || op == c10d::ReduceOp::MAX,
        "cudampi: reduce_scatter_tensor supports SUM, PRODUCT, MIN and MAX");
    auto flatInput = input.view(-1);
    auto received = at::empty_like(flatInput);
    std::vector<int64_t> equalSplits;
    auto exchange = CUDAMPI_ALL_TO_ALL_SINGLE(
        received, flatInput, equalSplits, equalSplits, c10d::AllToAllOptions());
    const int64_t size = getSize();
    // The worker thread runs entries in order: this one starts once the
    // exchange is done, and fails if the exchange did.
    std::function<void(std::unique_ptr<c10d::WorkEntry>&)> reduceReceived =
        [exchange, received, op, size](std::unique_ptr<c10d::WorkEntry>& entry) {
          if (exchange->exception()) {
            std::rethrow_exception(exchange->exception());
          }
          auto out = entry->dst[0];
          c10::DeviceGuard guard(out.device());
          auto blocks = received.view({size, -1});
          at::Tensor reduced;
          switch (op) {
            case c10d::ReduceOp::SUM:
              reduced = blocks.sum(0, false, out.scalar_type());
              break;
            case c10d::ReduceOp::PRODUCT:
              reduced = blocks.prod(0, false, out.scalar_type());
              break;
            case c10d::ReduceOp::MIN:
              reduced = blocks.amin(0);
              break;
            default:
              reduced = blocks.amax(0);
              break;
          }
          out.view(-1).copy_(reduced);
          // The reduction ran on this worker thread's stream: finish it before the work completes.
          waitForQueuedWork({out});
        };
    std::vector<at::Tensor> outputs{output};
    auto entry = std::make_unique<c10d::WorkEntry>(
        nullptr, &outputs, std::move(reduceReceived));
    return enqueue(
        std::move(entry),
        "mpi:reduce_scatter",
        std::optional<std::vector<at::Tensor>>({input}));
  }

 private:
  Composition composition_ = Composition::Cuda;
  int64_t composedAbove_ = kDefaultComposedAbove;
  bool profile_ = false;
  // The composition's working buffers, kept from one call to the next (see scratch()).
  std::mutex scratchMutex_;
  at::Tensor paddedScratch_;
  at::Tensor receivedScratch_;

  // Whether this call takes the composed path: one dense contiguous tensor of a dtype MPI moves,
  // more than one rank, counts within MPI's int, and a device the composition covers. A CUDA tensor
  // needs a CUDA device here (without one it cannot hold data, and PyTorch's own check decides).
  // Everything else keeps PyTorch's path and its errors.
  bool composes(const std::vector<at::Tensor>& tensors) const {
    if (composition_ == Composition::None || tensors.size() != 1 || getSize() < 2) {
      return false;
    }
    const auto& tensor = tensors[0];
    if (tensor.is_sparse() || !tensor.is_contiguous() || !mpiMovesDtype(tensor.scalar_type()) ||
        tensor.numel() == 0 || tensor.numel() > std::numeric_limits<int>::max()) {
      return false;
    }
    if (tensor.is_cuda()) {
      if (composition_ == Composition::Auto &&
          static_cast<int64_t>(tensor.nbytes()) <= composedAbove_) {
        return false;
      }
      const auto* impl = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
      return impl->deviceCount() > 0;
    }
    return composition_ == Composition::All && tensor.is_cpu();
  }

  // A working buffer of the composition, kept for the next call of the same size, dtype and device
  // (issue 57): with the CUDA caching allocator a new buffer is cheap, but one kept is the same
  // device address every call, which MPICH's IPC handle cache then finds. Safe to share between
  // calls: the worker thread runs one entry at a time, and every step that queues kernels on a
  // buffer synchronizes them before its entry ends, so no call's kernels or MPI calls overlap
  // another's use of it. A call of another shape replaces it (queued calls keep theirs alive).
  at::Tensor scratch(at::Tensor& kept, int64_t count, const at::Tensor& like) {
    std::lock_guard<std::mutex> lock(scratchMutex_);
    if (!kept.defined() || kept.numel() != count || kept.scalar_type() != like.scalar_type() ||
        kept.device() != like.device()) {
      kept = at::empty({count}, like.options());
    }
    return kept;
  }

  // The flat working buffer: the tensor itself when its count divides evenly by the world size,
  // else a buffer padded to a multiple of it. A padded buffer is filled on the worker thread, by an
  // entry queued before the exchange, so that calls queued earlier on the same tensor (async_op)
  // have written it by then; the padding is reduced and gathered but never read back.
  // Returns the buffer and the work that fills it (null when nothing is queued).
  std::pair<at::Tensor, c10::intrusive_ptr<c10d::Work>> workingBuffer(
      const at::Tensor& flat,
      int64_t chunk,
      const std::shared_ptr<CallRecord>& record) {
    const int64_t count = flat.numel();
    if (chunk * getSize() == count) {
      return {flat, nullptr};
    }
    auto padded = scratch(paddedScratch_, chunk * getSize(), flat);
    std::function<void(std::unique_ptr<c10d::WorkEntry>&)> copyIn =
        [padded, flat, count, record](std::unique_ptr<c10d::WorkEntry>&) {
          c10::DeviceGuard guard(flat.device());
          timedPhase(record, "pad_copy", &padded, [&] {
            padded.narrow(0, 0, count).copy_(flat);
            padded.narrow(0, count, padded.numel() - count).zero_();
          });
          // MPI reads padded next, outside any stream order.
          timedPhase(record, "synchronize", nullptr, [&] { waitForQueuedWork({padded}); });
        };
    std::vector<at::Tensor> tensors{padded};
    auto filled = enqueue(
        std::make_unique<c10d::WorkEntry>(&tensors, &tensors, std::move(copyIn)),
        "mpi:pad",
        std::optional<std::vector<at::Tensor>>(tensors));
    return {padded, filled};
  }

  // Profiling only: an entry ahead of the call's own, so that the time the worker thread took to
  // reach the call (calls queued before it, the hand-off) is a phase of its own ("queue").
  void enqueueQueueMark(const std::shared_ptr<CallRecord>& record) {
    if (!record) {
      return;
    }
    std::function<void(std::unique_ptr<c10d::WorkEntry>&)> mark =
        [record](std::unique_ptr<c10d::WorkEntry>&) { gapPhase(record, "queue"); };
    enqueue(std::make_unique<c10d::WorkEntry>(nullptr, nullptr, std::move(mark)), "mpi:profile");
  }

  // The worker thread runs entries in order, so the steps queued before the composition's last one
  // have run when it starts: it fails if one of them did.
  static void rethrowFailed(const std::vector<c10::intrusive_ptr<c10d::Work>>& steps) {
    for (const auto& step : steps) {
      if (step && step->exception()) {
        std::rethrow_exception(step->exception());
      }
    }
  }

  // The composition's last step, on the worker thread: every rank's chunk of `padded` is in place
  // at rank x chunk; gather them all in place, then copy back to the tensor if it was padded.
  void gatherInPlace(
      const at::Tensor& padded,
      const at::Tensor& flat,
      int64_t chunk,
      const std::shared_ptr<CallRecord>& record) {
    const int64_t count = flat.numel();
    timedPhase(record, "MPI_Allgather", nullptr, [&] {
      std::lock_guard<std::mutex> lock(pgGlobalMutex_);
      check(
          MPI_Allgather(
              MPI_IN_PLACE,
              0,
              MPI_DATATYPE_NULL,
              padded.data_ptr(),
              static_cast<int>(chunk * padded.element_size()),
              MPI_BYTE,
              pgComm_),
          "MPI_Allgather");
    });
    if (!padded.is_same(flat)) {
      timedPhase(record, "copy_back", &flat, [&] { flat.copy_(padded.narrow(0, 0, count)); });
      // Kept: the caller's stream is not ordered after this thread's, and the work completes here.
      timedPhase(record, "synchronize", nullptr, [&] { waitForQueuedWork({flat}); });
    }
  }

  // all_reduce as reduce-scatter + all-gather (the reduce_scatter_allgather algorithm, built from
  // MPI's fast paths): PyTorch's checked alltoall_base sends chunk j of every rank to rank j, rank j
  // reduces the chunks it received on the tensor's device, and MPI_Allgather puts every reduced chunk
  // back on every rank. Exact: each element is reduced once, over the same values MPI_Allreduce would.
  c10::intrusive_ptr<c10d::Work> composedAllreduce(
      const at::Tensor& tensor,
      c10d::ReduceOp::RedOpType op,
      const std::shared_ptr<CallRecord>& record) {
    const int64_t size = getSize();
    auto flat = tensor.view(-1);
    const int64_t chunk = (flat.numel() + size - 1) / size;
    if (record) {
      record->path = "composed";
    }
    enqueueQueueMark(record);
    auto [padded, filled] = workingBuffer(flat, chunk, record);
    auto received = scratch(receivedScratch_, padded.numel(), padded);
    std::vector<int64_t> equalSplits;
    // PyTorch's own all-to-all (alltoall_base, all_to_all_single from 2.14): its tensor checks (the
    // CUDA-aware one included) run here, in the caller, and refuse a tensor MPI cannot take before the
    // exchange is queued.
    auto exchange = ProcessGroupMPI::CUDAMPI_ALL_TO_ALL_SINGLE(
        received, padded, equalSplits, equalSplits, c10d::AllToAllOptions());
    const int64_t rank = getRank();
    std::function<void(std::unique_ptr<c10d::WorkEntry>&)> finish =
        [this, filled = filled, exchange, received, padded = padded, flat, op, size, chunk, rank, record](
            std::unique_ptr<c10d::WorkEntry>&) {
          gapPhase(record, "MPI_Alltoall");
          rethrowFailed({filled, exchange});
          c10::DeviceGuard guard(flat.device());
          auto mine = padded.narrow(0, rank * chunk, chunk);
          timedPhase(record, "reduce", &mine, [&] {
            reduceInto(mine, received.view({size, chunk}), op);
          });
          // MPI_Allgather reads the reduced chunk next, outside any stream order.
          timedPhase(record, "synchronize", nullptr, [&] { waitForQueuedWork({padded}); });
          gatherInPlace(padded, flat, chunk, record);
          finishRecord(record);
        };
    std::vector<at::Tensor> tensors{tensor};
    auto entry = std::make_unique<c10d::WorkEntry>(&tensors, &tensors, std::move(finish));
    return enqueue(
        std::move(entry), "mpi:all_reduce", std::optional<std::vector<at::Tensor>>(tensors));
  }

  // A profiled all_reduce that the composition leaves to PyTorch (MPI_Allreduce): its entry between
  // a queue mark and an entry of ours that times it and completes the call.
  c10::intrusive_ptr<c10d::Work> profiledMpiAllreduce(
      std::vector<at::Tensor>& tensors,
      const c10d::AllreduceOptions& opts,
      const std::shared_ptr<CallRecord>& record) {
    record->path = "mpi_allreduce";
    enqueueQueueMark(record);
    auto allreduced = ProcessGroupMPI::allreduce(tensors, opts);
    std::function<void(std::unique_ptr<c10d::WorkEntry>&)> finish =
        [allreduced, record](std::unique_ptr<c10d::WorkEntry>&) {
          gapPhase(record, "MPI_Allreduce");
          rethrowFailed({allreduced});
          finishRecord(record);
        };
    auto entry = std::make_unique<c10d::WorkEntry>(&tensors, &tensors, std::move(finish));
    return enqueue(
        std::move(entry), "mpi:all_reduce", std::optional<std::vector<at::Tensor>>(tensors));
  }
};

// The creator torch.distributed calls (through the Python shim) for every group using cudampi.
// globalRanks are the group's ranks in the default group; wholeWorld says they are all of them
// (the default group itself, or a new_group of every rank), so every process takes part.
// Every cudampi backend of this process, weakly: drainAll visits those still alive.
std::mutex liveBackendsMutex;
std::vector<c10::weak_intrusive_ptr<ProcessGroupCudaMPI>> liveBackends;

// At the interpreter's exit (torch_mpi_backend registers it with atexit, so it runs while the
// interpreter is whole, the GIL released here): let every live group's worker thread finish what is
// queued and drop it. Without this, a group still alive at the interpreter's teardown (a script that
// keeps its groups in a variable) was destroyed during finalization; its worker thread, dropping the
// last reference to a tensor of the last collective, took the GIL, and a finalizing Python ends such
// a thread with pthread_exit, whose unwinding through a destructor called std::terminate ("terminate
// called without an active exception"): 1 to 3 of 30-40 exits of a two-rank job with four subgroups
// aborted, and mpiexec reported the job as failed (issue 57's profile tests found it). A group whose
// worker is stuck (a hung collective) is left after 10 s, as before.
void drainAll() {
  std::vector<c10::intrusive_ptr<ProcessGroupCudaMPI>> live;
  {
    std::lock_guard<std::mutex> lock(liveBackendsMutex);
    for (auto& weak : liveBackends) {
      if (auto strong = weak.lock()) {
        live.push_back(std::move(strong));
      }
    }
  }
  const auto deadline = Clock::now() + std::chrono::seconds(10);
  for (auto& backend : live) {
    backend->drain(deadline);
  }
}

c10::intrusive_ptr<c10d::Backend> createBackend(
    const std::vector<int>& globalRanks,
    int groupRank,
    int groupSize,
    bool wholeWorld) {
  // Read first: a bad value fails before MPI starts.
  const Composition composition = compositionFromEnv();
  const int64_t composedAbove = composedAboveFromEnv();
  const bool profile = profileFromEnv();
  c10::intrusive_ptr<ProcessGroupCudaMPI> backend;
  if (wholeWorld) {
    backend = ProcessGroupCudaMPI::createWorld();
  } else {
    backend = ProcessGroupCudaMPI::createSubgroup(globalRanks);
  }
  backend->setComposition(composition, composedAbove);
  backend->setProfile(profile);
  {
    std::lock_guard<std::mutex> lock(liveBackendsMutex);
    liveBackends.emplace_back(backend);
  }
  // torch.distributed's ranks come from the launcher's variables (RANK, PMI_RANK, ...), MPI's from
  // MPI itself; if they disagree, every collective would silently pair the wrong peers.
  TORCH_CHECK(
      backend->getRank() == groupRank && backend->getSize() == groupSize,
      "cudampi: MPI places this process at rank ",
      backend->getRank(),
      " of ",
      backend->getSize(),
      " but torch.distributed was given rank ",
      groupRank,
      " of ",
      groupSize,
      "; start the job with the MPI launcher (mpiexec/srun) and let RANK and "
      "WORLD_SIZE follow it");
  return backend;
}

// Which MPI library this extension runs on, e.g. "MPICH Version: 4.0.2 ..." or
// "MPI VERSION : CRAY MPICH version 8.1.29 ..."; valid before MPI_Init.
std::string mpiLibraryVersion() {
  char version[MPI_MAX_LIBRARY_VERSION_STRING];
  int length = 0;
  check(MPI_Get_library_version(version, &length), "MPI_Get_library_version");
  return std::string(version, length);
}

// The profiled calls recorded so far (CUDAMPI_PROFILE=1), oldest first, as Python dicts.
py::list profileRecordsAsPython() {
  std::vector<CallRecord> records;
  {
    std::lock_guard<std::mutex> lock(profileMutex);
    records = profileRecords;
  }
  py::list out;
  for (const auto& record : records) {
    py::list phases;
    for (const auto& phase : record.phases) {
      py::dict item;
      item["name"] = phase.name;
      item["start_s"] = phase.startSeconds;
      item["wall_s"] = phase.wallSeconds;
      item["device_s"] = phase.deviceSeconds >= 0 ? py::cast(phase.deviceSeconds) : py::none();
      phases.append(item);
    }
    py::dict item;
    item["collective"] = "all_reduce";
    item["path"] = record.path;
    item["device"] = record.device;
    item["bytes"] = record.bytes;
    item["ranks"] = record.ranks;
    item["total_s"] = record.totalSeconds;
    item["phases"] = phases;
    out.append(item);
  }
  return out;
}

void profileReset() {
  std::lock_guard<std::mutex> lock(profileMutex);
  profileRecords.clear();
}

} // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "PyTorch's ProcessGroupMPI as the torch.distributed backend cudampi";
  m.def(
      "create_backend",
      &createBackend,
      py::arg("global_ranks"),
      py::arg("group_rank"),
      py::arg("group_size"),
      py::arg("whole_world"),
      py::call_guard<py::gil_scoped_release>());
  m.def("mpi_library_version", &mpiLibraryVersion);
  m.def(
      "composed_collectives",
      [] { return compositionName(compositionFromEnv()); },
      "Which all_reduce calls new groups compose (CUDAMPI_COMPOSED): cuda, all, none or auto");
  m.def(
      "composed_above",
      &composedAboveFromEnv,
      "With CUDAMPI_COMPOSED=auto, the largest CUDA all_reduce (bytes) new groups leave to "
      "MPI_Allreduce (CUDAMPI_COMPOSED_ABOVE)");
  m.def(
      "profile_records",
      &profileRecordsAsPython,
      "The phases of every all_reduce of groups created with CUDAMPI_PROFILE=1, oldest first");
  m.def("profile_reset", &profileReset, "Drop the profile records kept so far");
  m.def(
      "drain",
      &drainAll,
      py::call_guard<py::gil_scoped_release>(),
      "Let every live group's worker finish what is queued (at most 10 s); torch_mpi_backend calls it at exit");
}

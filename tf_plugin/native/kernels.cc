// TensorFlow ops over the shared-memory all-reduce (shm_allreduce.c), kept thin:
// the executor is plain C; this file only moves tensors and TensorFlow's `done`
// callback to it and back.
//
//   RdtShmAllreduceLaunch(tensor) -> handle   allocates the output, queues the
//       all-reduce on the group's executor thread, returns at once;
//   RdtShmAllreduceDone(handle, tensor) -> reduced   waits asynchronously (its
//       `done` is kept on the heap and called from the executor's completion),
//       holding no inter-op thread; `tensor` is the launch's input, for the
//       shape and the gradient (ops.py registers it);
//   RdtShmAllreduceLaunchMany(tensors) -> handles   several launches in one op;
//   RdtShmAllreduceDoneMany(handles, tensors) -> reduced   the same for several
//       launches at once: one hand-over back to TensorFlow for all of them;
//   RdtShmAllreduceLaunchFused(tensors) -> handle, pending   a fusion bucket:
//       its tensors (one dtype) as one request of parts, reduced in place (each
//       member this op alone holds is its own result's buffer, else a new output),
//       one launch however many members; `pending` are the results-to-be;
//   RdtShmAllreduceDoneFused(handle) -> ready   its completion: a token, no
//       tensors. One output: an asynchronous kernel's outputs are each handed to
//       TensorFlow's thread pool as a task of its own when it completes;
//   RdtShmAllreduceMembers(ready, pending) -> reduced   the results once the token
//       exists, handed on as they are: a synchronous op (TensorFlow runs the
//       consumers of its outputs inline). No copy, no allocation, no view: a
//       consumer that updates in place can take a result's buffer.
//
// The launches and completions are stateful: never folded, and chained in
// program order inside a tf.function, so the Python side emits every launch
// before any completion.
// A group is named by the `group` attribute and looked up at run time in this
// library's registry (ops.py adds and removes groups through the extern "C"
// functions below): a graph traced over a group that is gone fails with
// FailedPrecondition. A completion registers with the step's
// CancellationManager: a cancelled step cancels the request, which aborts the
// group (a collective left half done puts the ranks out of step).
#include <atomic>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "groups.h"
#include "shm_allreduce.h"
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"

#ifndef RDT_TF_VERSION
#error "build with -DRDT_TF_VERSION=\"<tf.__version__>\" (tf_plugin/native/build.py does)"
#endif

using namespace tensorflow;  // NOLINT

// What every all-reduce op carries: the reduction and the postscale the executor applies.
#define RDT_REDUCTION_ATTRS                                                  \
  .Attr("reduce_op: {'sum', 'average', 'min', 'max', 'product'} = 'sum'") \
      .Attr("scale: float = 1.0")

REGISTER_OP("RdtShmAllreduceLaunch")
    .Input("tensor: T")
    .Output("handle: int64")
    .Attr("T: {float, double, int32, int64, half}")
    .Attr("group: string")
    .Attr("bucket: int")
    RDT_REDUCTION_ATTRS
    .Attr("label: string = ''")
    .SetIsStateful()
    .SetShapeFn(shape_inference::ScalarShape);

REGISTER_OP("RdtShmAllreduceDone")
    .Input("handle: int64")
    .Input("tensor: T")
    .Output("reduced: T")
    .Attr("T: {float, double, int32, int64, half}")
    .Attr("group: string")
    .Attr("bucket: int")
    RDT_REDUCTION_ATTRS
    .Attr("label: string = ''")
    .SetIsStateful()
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      c->set_output(0, c->input(1));
      return absl::OkStatus();
    });

REGISTER_OP("RdtShmAllreduceLaunchMany")
    .Input("tensors: T")
    .Output("handles: N * int64")
    .Attr("T: list({float, double, int32, int64, half})")
    .Attr("N: int >= 1")
    .Attr("group: string")
    .Attr("buckets: list(int)")
    RDT_REDUCTION_ATTRS
    .Attr("labels: list(string)")
    .SetIsStateful()
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      for (int i = 0; i < c->num_outputs(); i++) c->set_output(i, c->Scalar());
      return absl::OkStatus();
    });

REGISTER_OP("RdtShmAllreduceDoneMany")
    .Input("handles: N * int64")
    .Input("tensors: T")
    .Output("reduced: T")
    .Attr("N: int >= 1")
    .Attr("T: list({float, double, int32, int64, half})")
    .Attr("group: string")
    .Attr("buckets: list(int)")
    RDT_REDUCTION_ATTRS
    .Attr("labels: list(string)")
    .SetIsStateful()
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      int n = c->num_outputs();
      for (int i = 0; i < n; i++) c->set_output(i, c->input(c->num_inputs() - n + i));
      return absl::OkStatus();
    });

REGISTER_OP("RdtShmAllreduceLaunchFused")
    .Input("tensors: N * T")
    .Output("handle: int64")
    .Output("pending: N * T")
    .Attr("T: {float, double, int32, int64, half}")
    .Attr("N: int >= 1")
    .Attr("group: string")
    .Attr("bucket: int")
    RDT_REDUCTION_ATTRS
    .Attr("label: string = ''")
    .SetIsStateful()
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      c->set_output(0, c->Scalar());
      for (int i = 0; i < c->num_inputs(); i++) c->set_output(1 + i, c->input(i));
      return absl::OkStatus();
    });

REGISTER_OP("RdtShmAllreduceDoneFused")
    .Input("handle: int64")
    .Output("ready: int64")
    .Attr("group: string")
    .Attr("bucket: int")
    RDT_REDUCTION_ATTRS
    .Attr("label: string = ''")
    .SetIsStateful()
    .SetShapeFn(shape_inference::ScalarShape);

REGISTER_OP("RdtShmAllreduceMembers")
    .Input("ready: int64")
    .Input("pending: N * T")
    .Output("reduced: N * T")
    .Attr("T: {float, double, int32, int64, half}")
    .Attr("N: int >= 1")
    .Attr("group: string")
    .Attr("bucket: int")
    RDT_REDUCTION_ATTRS
    .Attr("label: string = ''")
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      for (int i = 0; i < c->num_outputs(); i++) c->set_output(i, c->input(1 + i));
      return absl::OkStatus();
    });

namespace {

// ---------------------------------------------------------------- groups
struct GroupRef {
  rdt_shm_group* g;
  explicit GroupRef(rdt_shm_group* group) : g(group) { rdt_shm_group_retain(g); }
  ~GroupRef() { rdt_shm_group_release(g); }
};

std::mutex groups_mu;
std::unordered_map<std::string, std::shared_ptr<GroupRef>> groups;

std::shared_ptr<GroupRef> FindGroup(const std::string& name) {
  std::lock_guard<std::mutex> l(groups_mu);
  auto it = groups.find(name);
  return it == groups.end() ? nullptr : it->second;
}

// ---------------------------------------------------------------- requests
// One launched all-reduce, from its launch to its completion. Its handle is a
// slot of a table with a generation (no allocation per request once warm, and a
// stale or forged handle is refused, never followed).
struct Joint;

struct Pending {
  std::mutex mu;
  bool finished = false;
  int status = RDT_SHM_OK;
  std::string message;
  Tensor input, output;        // input: kept alive while the executor reads it
  // a fused launch's members the executor reads and results it writes (kept alive
  // until it is done), and where each part of the request comes from and goes to
  std::vector<Tensor> members, results;
  bool fused = false;
  std::vector<const void*> ins;
  std::vector<void*> outs;
  std::vector<uint64_t> counts;
  std::weak_ptr<GroupRef> group;
  uint64_t request = 0;
  std::shared_ptr<const std::string> label;   // the launch kernel's (it may go first)
  // the completion's, once it waits
  OpKernelContext* ctx = nullptr;
  AsyncOpKernel::DoneCallback done;
  CancellationManager* cm = nullptr;
  CancellationToken token = CancellationManager::kInvalidToken;
  std::shared_ptr<Pending> self;   // held from submit to the executor's callback
  std::shared_ptr<Joint> joint;    // a RdtShmAllreduceDoneMany waiting for this one among others
};

// One RdtShmAllreduceDoneMany: the requests it waits for, finished when the last one is.
struct Joint {
  std::mutex mu;
  int left = 0;
  std::vector<std::shared_ptr<Pending>> parts;
  OpKernelContext* ctx = nullptr;
  AsyncOpKernel::DoneCallback done;
  CancellationManager* cm = nullptr;
  CancellationToken token = CancellationManager::kInvalidToken;
};

void FinishJoint(Joint* j);

std::mutex slots_mu;
std::vector<std::shared_ptr<Pending>> slots;
std::vector<uint32_t> slot_generation;
std::vector<uint32_t> free_slots;
long launched = 0;

int64_t Put(std::shared_ptr<Pending> p) {
  std::lock_guard<std::mutex> l(slots_mu);
  uint32_t i;
  if (!free_slots.empty()) {
    i = free_slots.back();
    free_slots.pop_back();
  } else {
    i = static_cast<uint32_t>(slots.size());
    slots.emplace_back();
    slot_generation.push_back(0);
  }
  slots[i] = std::move(p);
  launched++;
  return (static_cast<int64_t>(++slot_generation[i] & 0x7fffffff) << 32) | i;
}

std::shared_ptr<Pending> Take(int64_t handle) {
  const uint32_t i = static_cast<uint32_t>(handle & 0xffffffff);
  const uint32_t generation = static_cast<uint32_t>(handle >> 32);
  std::lock_guard<std::mutex> l(slots_mu);
  if (handle < 0 || i >= slots.size() || slots[i] == nullptr || (slot_generation[i] & 0x7fffffff) != generation)
    return nullptr;
  std::shared_ptr<Pending> p = std::move(slots[i]);
  slots[i] = nullptr;
  free_slots.push_back(i);
  launched--;
  return p;
}

absl::Status StatusOf(int status, const std::string& message);

// The completion's end: the output or the error, then TensorFlow's `done`.
void Finish(Pending* p) {
  if (p->cm != nullptr && p->token != CancellationManager::kInvalidToken) {
    p->cm->DeregisterCallback(p->token);  // waits for a cancellation callback running now: it reads p
  }
  OpKernelContext* ctx = p->ctx;
  if (p->status == RDT_SHM_OK) {
    ctx->set_output(0, p->output);
  } else {
    ctx->SetStatus(StatusOf(p->status, p->message));
  }
  p->input = Tensor();
  p->members.clear();
  p->results.clear();
  AsyncOpKernel::DoneCallback done = std::move(p->done);
  p->done = nullptr;
  done();
}

void OnDone(void* arg, int status, const char* message) {  // the executor thread
  Pending* p = static_cast<Pending*>(arg);
  std::shared_ptr<Pending> keep;
  std::shared_ptr<Joint> j;
  bool waiting;
  {
    std::lock_guard<std::mutex> l(p->mu);
    keep = std::move(p->self);
    p->finished = true;
    p->status = status;
    if (status != RDT_SHM_OK) p->message = message ? message : "";
    waiting = p->ctx != nullptr;
    j = p->joint;
  }
  if (waiting) {
    Finish(p);
  } else if (j != nullptr) {
    bool last;
    {
      std::lock_guard<std::mutex> l(j->mu);
      last = --j->left == 0;
    }
    if (last) FinishJoint(j.get());
  }
}

void FinishJoint(Joint* j) {
  if (j->cm != nullptr && j->token != CancellationManager::kInvalidToken) j->cm->DeregisterCallback(j->token);
  OpKernelContext* ctx = j->ctx;
  for (size_t i = 0; i < j->parts.size(); i++) {
    Pending* p = j->parts[i].get();
    if (p->status != RDT_SHM_OK) {
      ctx->SetStatus(StatusOf(p->status, p->message));
      break;
    }
    ctx->set_output(static_cast<int>(i), p->output);
  }
  for (auto& p : j->parts) {
    p->input = Tensor();
    p->joint = nullptr;  // no cycle left: the parts go with the joint
  }
  AsyncOpKernel::DoneCallback done = std::move(j->done);
  j->done = nullptr;
  j->parts.clear();
  done();
}

void Cancel(Pending* p) {
  if (auto g = p->group.lock()) {
    std::string why = "the step was cancelled (another op failed) while all-reducing " + *p->label;
    rdt_shm_group_cancel(g->g, p->request, why.c_str());
  }
}

absl::Status StatusOf(int status, const std::string& message) {  // NOLINT
  switch (status) {
    case RDT_SHM_OK: return absl::OkStatus();
    case RDT_SHM_INVALID: return errors::InvalidArgument(message);
    case RDT_SHM_TIMEOUT: return errors::DeadlineExceeded(message);
    case RDT_SHM_ABORTED: return errors::Aborted(message);
    case RDT_SHM_PEER_ABORTED: return errors::Unavailable(message);
    case RDT_SHM_CANCELLED: return errors::Cancelled(message);
    case RDT_SHM_MISMATCH: return errors::FailedPrecondition(message);
    case RDT_SHM_CLOSED: return errors::Aborted(message);
    default: return errors::Internal(message);
  }
}

int DtypeCode(DataType t) {
  switch (t) {
    case DT_FLOAT: return RDT_SHM_FLOAT32;
    case DT_DOUBLE: return RDT_SHM_FLOAT64;
    case DT_INT32: return RDT_SHM_INT32;
    case DT_INT64: return RDT_SHM_INT64;
    case DT_HALF: return RDT_SHM_FLOAT16;
    default: return 0;
  }
}

using rdt::OpCode;

struct Attrs {
  std::string group, op, label;
  std::shared_ptr<const std::string> shared_label;
  int64_t bucket = 0;
  float scale = 1.0f;

  explicit Attrs(OpKernelConstruction* c) {
    OP_REQUIRES_OK(c, c->GetAttr("group", &group));
    OP_REQUIRES_OK(c, c->GetAttr("bucket", &bucket));
    OP_REQUIRES_OK(c, c->GetAttr("reduce_op", &op));
    OP_REQUIRES_OK(c, c->GetAttr("scale", &scale));
    OP_REQUIRES_OK(c, c->GetAttr("label", &label));
    if (label.empty()) label = c->def().name();
    shared_label = std::make_shared<const std::string>(label);
    OP_REQUIRES(c, bucket >= 0 && bucket <= UINT32_MAX,
                errors::InvalidArgument("all-reduce of ", label, ": bucket ", bucket, " is out of range"));
  }
};

// ---------------------------------------------------------------- the ops
// Queues p's request on `group`, its parts (ins, outs, counts) filled in: its handle in *handle.
absl::Status Submit(const std::shared_ptr<GroupRef>& group, std::shared_ptr<Pending> p, DataType type,
                    int64_t bucket, int op, float scale, const std::shared_ptr<const std::string>& label,
                    int64_t* handle) {
  const int dtype = DtypeCode(type);
  if (dtype == 0)
    return errors::InvalidArgument("all-reduce of ", *label, ": dtype ", DataTypeString(type), " is not supported");
  p->group = group;
  p->label = label;
  p->self = p;
  Pending* raw = p.get();
  const int64_t h = Put(std::move(p));
  char err[RDT_SHM_MESSAGE] = {0};
  std::unique_lock<std::mutex> l(raw->mu);  // the request id is in place before the executor's callback reads p
  uint64_t request = rdt_shm_group_submit_parts(group->g, static_cast<uint32_t>(bucket),
                                                static_cast<int>(raw->ins.size()), raw->ins.data(),
                                                raw->outs.data(), raw->counts.data(), dtype, op,
                                                static_cast<double>(scale), label->c_str(), OnDone, raw, err,
                                                sizeof err);
  if (request == 0) {
    raw->self = nullptr;
    l.unlock();
    Take(h);
    return errors::InvalidArgument(err);
  }
  raw->request = request;
  *handle = h;
  return absl::OkStatus();
}

// Queues the all-reduce of `in` into a new output on `group`: its handle in *handle.
absl::Status LaunchOne(OpKernelContext* ctx, const std::shared_ptr<GroupRef>& group, const Tensor& in,
                       int64_t bucket, int op, float scale, const std::shared_ptr<const std::string>& label,
                       int64_t* handle) {
  auto p = std::make_shared<Pending>();
  TF_RETURN_IF_ERROR(ctx->allocate_temp(in.dtype(), in.shape(), &p->output));
  p->input = in;
  p->ins.push_back(in.tensor_data().data());
  p->outs.push_back(const_cast<char*>(p->output.tensor_data().data()));
  p->counts.push_back(static_cast<uint64_t>(in.NumElements()));
  return Submit(group, std::move(p), in.dtype(), bucket, op, scale, label, handle);
}

absl::Status NotOpen(const std::string& group, const std::string& label) {
  return errors::FailedPrecondition("rdmatensor: the shm all-reduce group '", group,
                                    "' is not open in this process (closed, or never made); all-reduce of ", label,
                                    " cannot run");
}

// RdtShmAllreduceLaunch.
class LaunchOp : public OpKernel {
 public:
  explicit LaunchOp(OpKernelConstruction* c) : OpKernel(c), a_(c) {}

  void Compute(OpKernelContext* ctx) override {
    std::shared_ptr<GroupRef> group = FindGroup(a_.group);
    OP_REQUIRES(ctx, group != nullptr, NotOpen(a_.group, a_.label));
    int64_t handle = 0;
    OP_REQUIRES_OK(ctx, LaunchOne(ctx, group, ctx->input(0), a_.bucket, OpCode(a_.op), a_.scale, a_.shared_label,
                                  &handle));
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &out));
    out->scalar<int64_t>()() = handle;
  }

 private:
  Attrs a_;
};

// RdtShmAllreduceLaunchFused: a fusion bucket's members as one request of parts,
// reduced in place. A member this op alone holds (TensorFlow's refcount says so)
// is its own result's buffer: the executor copies it into its segment and the
// result back into it, with no allocation and no copy outside the executor; any
// other member gets a new output. The results are `pending` until the
// completion's token says the executor is done with them.
class LaunchFusedOp : public OpKernel {
 public:
  explicit LaunchFusedOp(OpKernelConstruction* c) : OpKernel(c), a_(c) {}

  void Compute(OpKernelContext* ctx) override {
    std::shared_ptr<GroupRef> group = FindGroup(a_.group);
    OP_REQUIRES(ctx, group != nullptr, NotOpen(a_.group, a_.label));
    OpInputList tensors;
    OP_REQUIRES_OK(ctx, ctx->input_list("tensors", &tensors));
    const int m = tensors.size();
    auto p = std::make_shared<Pending>();
    OP_REQUIRES_OK(ctx, ctx->allocate_temp(DT_INT64, TensorShape({}), &p->output));  // the completion's token
    p->output.scalar<int64_t>()() = 1;
    p->fused = true;
    p->results.reserve(m);
    p->ins.reserve(m);
    p->outs.reserve(m);
    p->counts.reserve(m);
    for (int i = 0; i < m; i++) {
      const Tensor& t = tensors[i];
      Tensor* out = nullptr;
      if (!ctx->forward_input_to_output_with_shape(i, 1 + i, t.shape(), &out)) {
        OP_REQUIRES_OK(ctx, ctx->allocate_output(1 + i, t.shape(), &out));
        p->members.push_back(t);   // read by the executor: kept until it is done
      }
      p->results.push_back(*out);  // written by the executor: kept until it is done
      p->ins.push_back(t.tensor_data().data());
      p->outs.push_back(const_cast<char*>(out->tensor_data().data()));
      p->counts.push_back(static_cast<uint64_t>(t.NumElements()));
    }
    int64_t handle = 0;
    OP_REQUIRES_OK(ctx, Submit(group, std::move(p), tensors[0].dtype(), a_.bucket, OpCode(a_.op), a_.scale,
                               a_.shared_label, &handle));
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &out));
    out->scalar<int64_t>()() = handle;
  }

 private:
  Attrs a_;
};

// Several launches in one op: one stateful op (one link of the program-order
// chain) for all of them. Every argument is checked before any is queued.
class LaunchManyOp : public OpKernel {
 public:
  explicit LaunchManyOp(OpKernelConstruction* c) : OpKernel(c) {
    std::vector<std::string> labels;
    OP_REQUIRES_OK(c, c->GetAttr("group", &group_));
    OP_REQUIRES_OK(c, c->GetAttr("buckets", &buckets_));
    OP_REQUIRES_OK(c, c->GetAttr("reduce_op", &op_));
    OP_REQUIRES_OK(c, c->GetAttr("scale", &scale_));
    OP_REQUIRES_OK(c, c->GetAttr("labels", &labels));
    OP_REQUIRES(c, labels.size() == buckets_.size(),
                errors::InvalidArgument("all-reduces: ", buckets_.size(), " buckets, ", labels.size(), " labels"));
    for (size_t i = 0; i < labels.size(); i++) {
      OP_REQUIRES(c, buckets_[i] >= 0 && buckets_[i] <= UINT32_MAX,
                  errors::InvalidArgument("all-reduce ", i, ": bucket ", buckets_[i], " is out of range"));
      labels_.push_back(std::make_shared<const std::string>(
          labels[i].empty() ? c->def().name() + "/" + std::to_string(i) : labels[i]));
    }
  }

  void Compute(OpKernelContext* ctx) override {
    OpInputList tensors;
    OP_REQUIRES_OK(ctx, ctx->input_list("tensors", &tensors));
    const int n = tensors.size();
    OP_REQUIRES(ctx, n == static_cast<int>(buckets_.size()) && n == ctx->num_outputs(),
                errors::InvalidArgument("all-reduces: ", n, " tensors, ", buckets_.size(), " buckets, ",
                                        ctx->num_outputs(), " handles"));
    std::shared_ptr<GroupRef> group = FindGroup(group_);
    OP_REQUIRES(ctx, group != nullptr, NotOpen(group_, *labels_[0]));
    std::vector<std::shared_ptr<Pending>> ps(n);
    std::vector<uint32_t> buckets(n);
    std::vector<const void*> ins(n);
    std::vector<void*> outs(n), args(n);
    std::vector<uint64_t> counts(n), ids(n);
    std::vector<int> dtypes(n);
    std::vector<const char*> labels(n);
    for (int i = 0; i < n; i++) {
      const Tensor& in = tensors[i];
      dtypes[i] = DtypeCode(in.dtype());
      OP_REQUIRES(ctx, dtypes[i] != 0,
                  errors::InvalidArgument("all-reduce of ", *labels_[i], ": dtype ", DataTypeString(in.dtype()),
                                          " is not supported"));
      auto p = std::make_shared<Pending>();
      OP_REQUIRES_OK(ctx, ctx->allocate_temp(in.dtype(), in.shape(), &p->output));
      p->input = in;
      p->group = group;
      p->label = labels_[i];
      buckets[i] = static_cast<uint32_t>(buckets_[i]);
      ins[i] = in.tensor_data().data();
      outs[i] = const_cast<char*>(p->output.tensor_data().data());
      counts[i] = static_cast<uint64_t>(in.NumElements());
      labels[i] = labels_[i]->c_str();
      args[i] = p.get();
      ps[i] = std::move(p);
    }
    std::vector<int64_t> handles(n);
    for (int i = 0; i < n; i++) {
      ps[i]->self = ps[i];
      handles[i] = Put(ps[i]);
    }
    char err[RDT_SHM_MESSAGE] = {0};
    // One submission for all: every request checked first, then queued at once (one wake of the executor).
    if (rdt_shm_group_submit_many(group->g, n, buckets.data(), ins.data(), outs.data(), counts.data(),
                                  dtypes.data(), OpCode(op_), static_cast<double>(scale_), labels.data(), OnDone,
                                  args.data(), ids.data(), err, sizeof err) != 0) {
      for (int i = 0; i < n; i++) {
        ps[i]->self = nullptr;
        Take(handles[i]);
      }
      ctx->SetStatus(errors::InvalidArgument(err));
      return;
    }
    for (int i = 0; i < n; i++) {
      {
        std::lock_guard<std::mutex> l(ps[i]->mu);
        ps[i]->request = ids[i];
      }
      Tensor* out = nullptr;
      OP_REQUIRES_OK(ctx, ctx->allocate_output(i, TensorShape({}), &out));
      out->scalar<int64_t>()() = handles[i];
    }
  }

 private:
  std::string group_, op_;
  std::vector<int64_t> buckets_;
  std::vector<std::shared_ptr<const std::string>> labels_;
  float scale_ = 1.0f;
};

// RdtShmAllreduceDone, and RdtShmAllreduceDoneFused (`fused`: a fused launch's
// completion, whose output is only a token: RdtShmAllreduceMembers, which takes it,
// gives the results).
class DoneOp : public AsyncOpKernel {
 public:
  explicit DoneOp(OpKernelConstruction* c, bool fused = false) : AsyncOpKernel(c), a_(c), fused_(fused) {}

  void ComputeAsync(OpKernelContext* ctx, DoneCallback done) override {
    const Tensor& h = ctx->input(0);
    OP_REQUIRES_ASYNC(ctx, TensorShapeUtils::IsScalar(h.shape()),
                      errors::InvalidArgument("all-reduce of ", a_.label, ": the handle must be a scalar"), done);
    const int64_t handle = h.scalar<int64_t>()();
    std::shared_ptr<Pending> p = Take(handle);
    OP_REQUIRES_ASYNC(ctx, p != nullptr,
                      errors::InvalidArgument("all-reduce of ", a_.label, ": handle ", handle,
                                              " is unknown (completed already, or never launched)"),
                      done);
    if (p->fused != fused_) {
      OP_REQUIRES_ASYNC(ctx, false,
                        errors::InvalidArgument("all-reduce of ", a_.label, ": handle ", handle, " is of ",
                                                p->fused ? "a fused launch" : "a launch that is not fused",
                                                ", this completion of ", fused_ ? "a fused one" : "one not fused"),
                        done);
    }
    std::unique_lock<std::mutex> l(p->mu);
    if (p->finished) {             // the usual case once the executor is ahead: no wait, no cancellation
      l.unlock();
      p->ctx = ctx;
      p->done = std::move(done);
      Finish(p.get());
      return;
    }
    CancellationManager* cm = ctx->cancellation_manager();
    bool cancelled = false;
    if (cm != nullptr) {
      p->token = cm->get_cancellation_token();
      Pending* raw = p.get();      // alive until Finish deregisters this callback
      if (cm->RegisterCallback(p->token, [raw] { Cancel(raw); })) {
        p->cm = cm;
      } else {
        p->token = CancellationManager::kInvalidToken;
        cancelled = true;          // cancelled already
      }
    }
    p->ctx = ctx;
    p->done = std::move(done);
    l.unlock();                    // from here the executor's callback may finish it
    if (cancelled) Cancel(p.get());
  }

 private:
  Attrs a_;
  bool fused_;
};

class DoneFusedOp : public DoneOp {
 public:
  explicit DoneFusedOp(OpKernelConstruction* c) : DoneOp(c, true) {}
};

// Waits for several launched all-reduces at once: one asynchronous completion
// (one hand-over back to TensorFlow) for all of them.
class DoneManyOp : public AsyncOpKernel {
 public:
  explicit DoneManyOp(OpKernelConstruction* c) : AsyncOpKernel(c) {}

  void ComputeAsync(OpKernelContext* ctx, DoneCallback done) override {
    OpInputList handles, tensors;
    OP_REQUIRES_OK_ASYNC(ctx, ctx->input_list("handles", &handles), done);
    OP_REQUIRES_OK_ASYNC(ctx, ctx->input_list("tensors", &tensors), done);
    OP_REQUIRES_ASYNC(ctx, handles.size() == tensors.size(),
                      errors::InvalidArgument("all-reduces: ", handles.size(), " handles for ", tensors.size(),
                                              " tensors"),
                      done);
    auto j = std::make_shared<Joint>();
    j->parts.reserve(handles.size());
    for (int i = 0; i < handles.size(); i++) {
      OP_REQUIRES_ASYNC(ctx, TensorShapeUtils::IsScalar(handles[i].shape()),
                        errors::InvalidArgument("all-reduces: handle ", i, " must be a scalar"), done);
      const int64_t handle = handles[i].scalar<int64_t>()();
      std::shared_ptr<Pending> p = Take(handle);
      OP_REQUIRES_ASYNC(ctx, p != nullptr,
                        errors::InvalidArgument("all-reduces: handle ", handle,
                                                " is unknown (completed already, or never launched)"),
                        done);
      j->parts.push_back(std::move(p));
    }
    j->ctx = ctx;
    j->done = std::move(done);
    {
      std::lock_guard<std::mutex> l(j->mu);
      j->left = static_cast<int>(j->parts.size()) + 1;  // + 1: this call, until every part is attached
    }
    int finished = 0;
    for (auto& p : j->parts) {
      std::lock_guard<std::mutex> l(p->mu);
      if (p->finished) finished++;
      else p->joint = j;
    }
    CancellationManager* cm = ctx->cancellation_manager();
    bool cancelled = false;
    if (finished < static_cast<int>(j->parts.size()) && cm != nullptr) {
      std::lock_guard<std::mutex> l(j->mu);
      j->token = cm->get_cancellation_token();
      Joint* raw = j.get();  // alive until FinishJoint deregisters this callback
      if (cm->RegisterCallback(j->token, [raw] {
            for (auto& p : raw->parts) Cancel(p.get());
          })) {
        j->cm = cm;
      } else {
        j->token = CancellationManager::kInvalidToken;
        cancelled = true;
      }
    }
    if (cancelled)
      for (auto& p : j->parts) Cancel(p.get());
    bool last;
    {
      std::lock_guard<std::mutex> l(j->mu);
      j->left -= finished + 1;
      last = j->left == 0;
    }
    if (last) FinishJoint(j.get());
  }
};

}  // namespace

int rdt::OpCode(const std::string& op) {
  if (op == "sum") return RDT_SHM_SUM;
  if (op == "average") return RDT_SHM_AVERAGE;
  if (op == "min") return RDT_SHM_MIN;
  if (op == "max") return RDT_SHM_MAX;
  if (op == "product") return RDT_SHM_PRODUCT;
  return 0;
}

rdt_shm_group* rdt::AcquireGroup(const std::string& name) {
  std::shared_ptr<GroupRef> ref = FindGroup(name);
  if (ref == nullptr) return nullptr;
  rdt_shm_group_retain(ref->g);
  return ref->g;
}

// RdtShmAllreduceMembers: a fused launch's results, once its completion's token
// exists (the executor is done with them), handed on as they are. Synchronous:
// TensorFlow runs the consumers of a synchronous op's outputs inline, where an
// asynchronous op's would each be a task of its own on its thread pool.
class MembersOp : public OpKernel {
 public:
  explicit MembersOp(OpKernelConstruction* c) : OpKernel(c) {}

  void Compute(OpKernelContext* ctx) override {
    for (int i = 0; i < ctx->num_outputs(); i++) ctx->set_output(i, ctx->input(1 + i));
  }
};

REGISTER_KERNEL_BUILDER(Name("RdtShmAllreduceLaunch").Device(DEVICE_CPU), LaunchOp);
REGISTER_KERNEL_BUILDER(Name("RdtShmAllreduceLaunchMany").Device(DEVICE_CPU), LaunchManyOp);
REGISTER_KERNEL_BUILDER(Name("RdtShmAllreduceDone").Device(DEVICE_CPU), DoneOp);
REGISTER_KERNEL_BUILDER(Name("RdtShmAllreduceDoneMany").Device(DEVICE_CPU), DoneManyOp);
REGISTER_KERNEL_BUILDER(Name("RdtShmAllreduceLaunchFused").Device(DEVICE_CPU), LaunchFusedOp);
REGISTER_KERNEL_BUILDER(Name("RdtShmAllreduceDoneFused").Device(DEVICE_CPU), DoneFusedOp);
REGISTER_KERNEL_BUILDER(Name("RdtShmAllreduceMembers").Device(DEVICE_CPU), MembersOp);

// ---------------------------------------------------------------- for ops.py (ctypes)
extern "C" {

// The TensorFlow version this library was built against.
const char* rdt_tf_version() { return RDT_TF_VERSION; }

// Registers `g` under `name` (the registry holds a reference of its own): 0, or
// -1 when the name is taken.
int rdt_tf_group_add(const char* name, rdt_shm_group* g) {
  auto ref = std::make_shared<GroupRef>(g);
  std::lock_guard<std::mutex> l(groups_mu);
  return groups.emplace(name, std::move(ref)).second ? 0 : -1;
}

// Forgets `name`: ops naming it fail from now on. 0, or -1 when unknown.
int rdt_tf_group_remove(const char* name) {
  std::shared_ptr<GroupRef> gone;
  {
    std::lock_guard<std::mutex> l(groups_mu);
    auto it = groups.find(name);
    if (it == groups.end()) return -1;
    gone = std::move(it->second);
    groups.erase(it);
  }
  return 0;  // `gone` released here, outside the lock
}

// Launched all-reduces whose completion has not run yet.
long rdt_tf_pending() {
  std::lock_guard<std::mutex> l(slots_mu);
  return launched;
}
}

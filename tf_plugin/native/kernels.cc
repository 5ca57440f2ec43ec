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
//   RdtShmAllreduceLaunchFused(tensors) -> handle   a fusion bucket: its tensors
//       (one dtype) copied back to back into one request, one launch;
//   RdtShmAllreduceDoneFused(handle, tensors) -> reduced   its completion: the
//       result as one flat tensor, the members' elements back to back (the
//       members are inputs for their sizes and the gradient). One output: an
//       asynchronous kernel's outputs are each handed to TensorFlow's thread pool
//       as a task of its own when it completes, so one output per member cost
//       more than the members' split and reshapes in the graph after it.
//   RdtMembers(flat) -> members   the flat result as one tensor per member,
//       shaped as it: a synchronous op with one output per member (TensorFlow
//       runs their consumers inline, unlike an asynchronous op's). A member that
//       starts on an aligned address is a view of the flat buffer, no copy (a
//       fused launch places its members back to back, so members whose sizes
//       are multiples of 64 bytes are all views); the others are copied out.
//
// Both are stateful: never folded, and chained in program order inside a
// tf.function, so the Python side emits every launch before any completion.
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
    .Attr("T: {float, double, int32, int64, half}")
    .Attr("N: int >= 1")
    .Attr("group: string")
    .Attr("bucket: int")
    RDT_REDUCTION_ATTRS
    .Attr("label: string = ''")
    .SetIsStateful()
    .SetShapeFn(shape_inference::ScalarShape);

REGISTER_OP("RdtShmAllreduceDoneFused")
    .Input("handle: int64")
    .Input("tensors: N * T")
    .Output("reduced: T")
    .Attr("T: {float, double, int32, int64, half}")
    .Attr("N: int >= 1")
    .Attr("group: string")
    .Attr("bucket: int")
    RDT_REDUCTION_ATTRS
    .Attr("label: string = ''")
    .SetIsStateful()
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      int64_t total = 0;
      for (int i = 1; i < c->num_inputs() && total >= 0; i++) {
        shape_inference::DimensionHandle n = c->NumElements(c->input(i));
        total = c->ValueKnown(n) ? total + c->Value(n) : -1;
      }
      c->set_output(0, c->Vector(total >= 0 ? c->MakeDim(total) : c->UnknownDim()));
      return absl::OkStatus();
    });

REGISTER_OP("RdtMembers")
    .Input("flat: T")
    .Output("members: N * T")
    .Attr("T: {float, double, int32, int64, half}")
    .Attr("N: int >= 1")
    .Attr("shapes: list(shape)")
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      std::vector<PartialTensorShape> shapes;
      TF_RETURN_IF_ERROR(c->GetAttr("shapes", &shapes));
      if (static_cast<int>(shapes.size()) != c->num_outputs())
        return errors::InvalidArgument("RdtMembers: ", shapes.size(), " shapes for ", c->num_outputs(),
                                       " members");
      for (int i = 0; i < c->num_outputs(); i++) {
        shape_inference::ShapeHandle out;
        TF_RETURN_IF_ERROR(c->MakeShapeFromPartialTensorShape(shapes[i], &out));
        c->set_output(i, out);
      }
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
  // a fused launch's members (kept alive while the executor reads them) and where
  // each part of the request comes from and goes to
  std::vector<Tensor> members;
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
// Queues the all-reduce of `in` on `group`: its handle in *handle.
// `members` (a fused launch): `in` is their flat shape, and the executor copies each
// member into its segment itself (parts), where a graph would concatenate them first.
absl::Status LaunchOne(OpKernelContext* ctx, const std::shared_ptr<GroupRef>& group, const Tensor& in,
                       int64_t bucket, int op, float scale, const std::shared_ptr<const std::string>& label,
                       int64_t* handle, const OpInputList* members = nullptr) {
  const int dtype = DtypeCode(in.dtype());
  if (dtype == 0)
    return errors::InvalidArgument("all-reduce of ", *label, ": dtype ", DataTypeString(in.dtype()),
                                   " is not supported");
  auto p = std::make_shared<Pending>();
  TF_RETURN_IF_ERROR(ctx->allocate_temp(in.dtype(), in.shape(), &p->output));
  char* dst = const_cast<char*>(p->output.tensor_data().data());
  if (members != nullptr) {
    const int m = members->size();
    p->members.reserve(m);
    p->ins.reserve(m);
    p->outs.reserve(m);
    p->counts.reserve(m);
    for (int i = 0; i < m; i++) {
      const Tensor& t = (*members)[i];
      p->members.push_back(t);
      p->ins.push_back(t.tensor_data().data());
      p->outs.push_back(dst);
      p->counts.push_back(static_cast<uint64_t>(t.NumElements()));
      dst += t.tensor_data().size();
    }
  } else {
    p->input = in;
    p->ins.push_back(in.tensor_data().data());
    p->outs.push_back(dst);
    p->counts.push_back(static_cast<uint64_t>(in.NumElements()));
  }
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

absl::Status NotOpen(const std::string& group, const std::string& label) {
  return errors::FailedPrecondition("rdmatensor: the shm all-reduce group '", group,
                                    "' is not open in this process (closed, or never made); all-reduce of ", label,
                                    " cannot run");
}

// RdtShmAllreduceLaunch, and RdtShmAllreduceLaunchFused (`fused`: a fusion
// bucket's tensors copied back to back into one request: one launch however many
// members; their copy is the concatenation a graph would make).
class LaunchOp : public OpKernel {
 public:
  explicit LaunchOp(OpKernelConstruction* c, bool fused = false) : OpKernel(c), a_(c), fused_(fused) {}

  void Compute(OpKernelContext* ctx) override {
    std::shared_ptr<GroupRef> group = FindGroup(a_.group);
    OP_REQUIRES(ctx, group != nullptr, NotOpen(a_.group, a_.label));
    Tensor in = ctx->input(0);
    OpInputList tensors;
    if (fused_) {
      OP_REQUIRES_OK(ctx, ctx->input_list("tensors", &tensors));
      int64_t total = 0;
      for (int i = 0; i < tensors.size(); i++) total += tensors[i].NumElements();
      in = Tensor(tensors[0].dtype(), TensorShape({total}), static_cast<TensorBuffer*>(nullptr));  // no buffer
    }
    int64_t handle = 0;
    OP_REQUIRES_OK(ctx, LaunchOne(ctx, group, in, a_.bucket, OpCode(a_.op), a_.scale, a_.shared_label, &handle,
                                  fused_ ? &tensors : nullptr));
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &out));
    out->scalar<int64_t>()() = handle;
  }

 private:
  Attrs a_;
  bool fused_;
};

class LaunchFusedOp : public LaunchOp {
 public:
  explicit LaunchFusedOp(OpKernelConstruction* c) : LaunchOp(c, true) {}
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

// RdtShmAllreduceDone, and RdtShmAllreduceDoneFused (`fused`: the members after the
// handle hold as many elements as the launch).
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
    if (fused_) {
      int64_t total = 0;
      for (int i = 1; i < ctx->num_inputs(); i++) total += ctx->input(i).NumElements();
      OP_REQUIRES_ASYNC(ctx, total == p->output.NumElements() && ctx->input(1).dtype() == p->output.dtype(),
                        errors::InvalidArgument("all-reduce of ", a_.label, ": the members hold ", total,
                                                " elements, the launch ", p->output.NumElements()),
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

// RdtMembers: the members' views of (or copies out of) the flat result.
class MembersOp : public OpKernel {
 public:
  explicit MembersOp(OpKernelConstruction* c) : OpKernel(c) {
    std::vector<PartialTensorShape> shapes;
    OP_REQUIRES_OK(c, c->GetAttr("shapes", &shapes));
    for (const PartialTensorShape& s : shapes) {
      TensorShape full;
      OP_REQUIRES(c, s.AsTensorShape(&full),
                  errors::InvalidArgument("RdtMembers: member shape ", s.DebugString(), " is not fully defined"));
      shapes_.push_back(full);
      total_ += full.num_elements();
    }
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& flat = ctx->input(0);
    OP_REQUIRES(ctx, ctx->num_outputs() == static_cast<int>(shapes_.size()),
                errors::InvalidArgument("RdtMembers: ", shapes_.size(), " shapes for ", ctx->num_outputs(),
                                        " members"));
    OP_REQUIRES(ctx, TensorShapeUtils::IsVector(flat.shape()) && flat.NumElements() == total_,
                errors::InvalidArgument("RdtMembers: the members hold ", total_, " elements, the flat result ",
                                        flat.shape().DebugString()));
    const size_t item = DataTypeSize(flat.dtype());
    int64_t start = 0;
    for (size_t i = 0; i < shapes_.size(); i++) {
      const int64_t n = shapes_[i].num_elements();
      Tensor view;
      // a view shares the flat buffer (TensorFlow never writes into a shared one in place)
      if (n > 0 && view.CopyFrom(flat.Slice(start, start + n), shapes_[i]) && view.IsAligned()) {
        ctx->set_output(i, view);
      } else {
        Tensor* out = nullptr;
        OP_REQUIRES_OK(ctx, ctx->allocate_output(i, shapes_[i], &out));
        if (n > 0) std::memcpy(const_cast<char*>(out->tensor_data().data()),
                               flat.tensor_data().data() + start * item, n * item);
      }
      start += n;
    }
  }

 private:
  std::vector<TensorShape> shapes_;
  int64_t total_ = 0;
};

REGISTER_KERNEL_BUILDER(Name("RdtShmAllreduceLaunch").Device(DEVICE_CPU), LaunchOp);
REGISTER_KERNEL_BUILDER(Name("RdtShmAllreduceLaunchMany").Device(DEVICE_CPU), LaunchManyOp);
REGISTER_KERNEL_BUILDER(Name("RdtShmAllreduceDone").Device(DEVICE_CPU), DoneOp);
REGISTER_KERNEL_BUILDER(Name("RdtShmAllreduceDoneMany").Device(DEVICE_CPU), DoneManyOp);
REGISTER_KERNEL_BUILDER(Name("RdtShmAllreduceLaunchFused").Device(DEVICE_CPU), LaunchFusedOp);
REGISTER_KERNEL_BUILDER(Name("RdtShmAllreduceDoneFused").Device(DEVICE_CPU), DoneFusedOp);
REGISTER_KERNEL_BUILDER(Name("RdtMembers").Device(DEVICE_CPU), MembersOp);

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

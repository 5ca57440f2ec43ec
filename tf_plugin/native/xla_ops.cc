// The shared-memory all-reduce inside XLA (tf.function(jit_compile=True)): the
// route docs/native-ops-spike.md decided.
//
//   RdtShmAllreduceXla(tensors, token) -> (reduced, token)   a fusion bucket's
//       all-reduce, as RdtShmAllreduceLaunchFused + DoneFused do it outside XLA.
//       It has no CPU kernel: ops.py emits it only inside an XLA context.
//
// Its XLA kernel emits one typed-FFI custom call, "rdt_shm_allreduce" on the Host
// platform (XLA's maintainers are removing the legacy custom calls), whose
// handler below packs the members into one buffer, runs the request on the
// group's executor, waits for it (XLA's thread waits; the executor's does the
// work) and unpacks. The call's first operand is a constant naming the request's
// settings (group, bucket, op, scale, label: registered when the kernel compiles),
// its last the token of the previous all-reduce of the graph and its last result
// the next token: the calls are chained by data, so every rank runs them in one
// order. This library must be loaded before the process's first XLA
// compilation (tf_plugin loads it at hvd.init()).
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include "groups.h"
#include "shm_allreduce.h"
#include "tensorflow/compiler/tf2xla/xla_op_kernel.h"
#include "tensorflow/compiler/tf2xla/xla_op_registry.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "xla/ffi/api/ffi.h"
#include "xla/hlo/builder/xla_builder.h"
#include "xla/shape_util.h"

namespace xla::ffi {
const XLA_FFI_Api* GetXlaFfiApi();  // exported by libtensorflow_cc.so.2
}

namespace ffi = xla::ffi;
using namespace tensorflow;  // NOLINT

REGISTER_OP("RdtShmAllreduceXla")
    .Input("tensors: N * T")
    .Input("token: int32")
    .Output("reduced: N * T")
    .Output("token_out: int32")
    .Attr("T: {float, double, int32, int64, half}")
    .Attr("N: int >= 1")
    .Attr("group: string")
    .Attr("bucket: int")
    .Attr("reduce_op: {'sum', 'average', 'min', 'max', 'product'} = 'sum'")
    .Attr("scale: float = 1.0")
    .Attr("label: string = ''")
    .SetIsStateful()
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      const int n = c->num_outputs() - 1;
      for (int i = 0; i < n; i++) c->set_output(i, c->input(i));
      c->set_output(n, c->Scalar());
      return absl::OkStatus();
    });

namespace {

struct Settings {
  std::string group, label;
  uint32_t bucket = 0;
  int op = 0;
  double scale = 1.0;
};

// Every compiled call's settings, by the id its first operand holds: a handful
// per traced step, kept for the process's life (a compiled program may run long
// after its kernel compiled).
std::mutex settings_mu;
std::vector<Settings> settings;

int64_t Register(Settings s) {
  std::lock_guard<std::mutex> l(settings_mu);
  settings.push_back(std::move(s));
  return static_cast<int64_t>(settings.size()) - 1;
}

bool Lookup(int64_t id, Settings* out) {
  std::lock_guard<std::mutex> l(settings_mu);
  if (id < 0 || id >= static_cast<int64_t>(settings.size())) return false;
  *out = settings[id];
  return true;
}

class AllreduceXlaOp : public XlaOpKernel {
 public:
  explicit AllreduceXlaOp(OpKernelConstruction* c) : XlaOpKernel(c) {
    std::string op;
    int64_t bucket = 0;
    float scale = 1.0f;
    OP_REQUIRES_OK(c, c->GetAttr("group", &s_.group));
    OP_REQUIRES_OK(c, c->GetAttr("bucket", &bucket));
    OP_REQUIRES_OK(c, c->GetAttr("reduce_op", &op));
    OP_REQUIRES_OK(c, c->GetAttr("scale", &scale));
    OP_REQUIRES_OK(c, c->GetAttr("label", &s_.label));
    OP_REQUIRES(c, bucket >= 0 && bucket <= UINT32_MAX,
                errors::InvalidArgument("all-reduce of ", s_.label, ": bucket ", bucket, " is out of range"));
    if (s_.label.empty()) s_.label = c->def().name();
    s_.bucket = static_cast<uint32_t>(bucket);
    s_.op = rdt::OpCode(op);
    s_.scale = scale;
  }

  void Compile(XlaOpKernelContext* ctx) override {
    const int n = ctx->num_inputs() - 1;
    std::vector<xla::XlaOp> operands{xla::ConstantR0<int64_t>(ctx->builder(), Register(s_))};
    std::vector<xla::Shape> shapes;
    for (int i = 0; i <= n; i++) {
      auto shape = ctx->InputXlaShape(i);
      OP_REQUIRES_OK(ctx, shape.status());
      operands.push_back(ctx->Input(i));
      shapes.push_back(*shape);   // the members', then the token's
    }
    xla::XlaOp call = xla::CustomCall(ctx->builder(), "rdt_shm_allreduce", operands,
                                      xla::ShapeUtil::MakeTupleShape(shapes), /*opaque=*/"",
                                      /*has_side_effect=*/true, {}, nullptr, xla::CustomCallSchedule::SCHEDULE_NONE,
                                      xla::CustomCallApiVersion::API_VERSION_TYPED_FFI);
    for (int i = 0; i <= n; i++) ctx->SetOutput(i, xla::GetTupleElement(call, i));
  }

 private:
  Settings s_;
};

REGISTER_XLA_OP(Name("RdtShmAllreduceXla"), AllreduceXlaOp);

int DtypeCode(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32: return RDT_SHM_FLOAT32;
    case ffi::DataType::F64: return RDT_SHM_FLOAT64;
    case ffi::DataType::S32: return RDT_SHM_INT32;
    case ffi::DataType::S64: return RDT_SHM_INT64;
    case ffi::DataType::F16: return RDT_SHM_FLOAT16;
    default: return 0;
  }
}

ffi::ErrorCode CodeOf(int status) {
  switch (status) {
    case RDT_SHM_INVALID: return ffi::ErrorCode::kInvalidArgument;
    case RDT_SHM_TIMEOUT: return ffi::ErrorCode::kDeadlineExceeded;
    case RDT_SHM_ABORTED: return ffi::ErrorCode::kAborted;
    case RDT_SHM_PEER_ABORTED: return ffi::ErrorCode::kUnavailable;
    case RDT_SHM_CANCELLED: return ffi::ErrorCode::kCancelled;
    case RDT_SHM_MISMATCH: return ffi::ErrorCode::kFailedPrecondition;
    case RDT_SHM_CLOSED: return ffi::ErrorCode::kAborted;
    default: return ffi::ErrorCode::kInternal;
  }
}

// Holds a group reference for the call.
struct Held {
  rdt_shm_group* g;
  ~Held() {
    if (g != nullptr) rdt_shm_group_release(g);
  }
};

ffi::Error Allreduce(ffi::RemainingArgs args, ffi::RemainingRets rets) {
  if (args.size() < 3 || rets.size() != args.size() - 1)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "rdt_shm_allreduce: malformed call");
  const size_t n = args.size() - 2;   // [settings, members..., token]
  auto id = args.get<ffi::AnyBuffer>(0);
  auto token = args.get<ffi::AnyBuffer>(n + 1);
  if (!id.has_value() || !token.has_value())
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "rdt_shm_allreduce: malformed call");
  Settings s;
  if (!Lookup(*static_cast<const int64_t*>(id->untyped_data()), &s))
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "rdt_shm_allreduce: unknown settings");
  std::vector<ffi::AnyBuffer> in;
  std::vector<ffi::Result<ffi::AnyBuffer>> out;
  size_t total = 0, elements = 0;
  for (size_t i = 0; i < n; i++) {
    auto a = args.get<ffi::AnyBuffer>(i + 1);
    auto r = rets.get<ffi::AnyBuffer>(i);
    if (!a.has_value() || !r.has_value())
      return ffi::Error(ffi::ErrorCode::kInvalidArgument, "rdt_shm_allreduce: a member is not a buffer");
    total += a->size_bytes();
    elements += a->element_count();
    in.push_back(*a);
    out.push_back(*r);
  }
  const int dtype = DtypeCode(in[0].element_type());
  if (dtype == 0)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "all-reduce of " + s.label + ": dtype not supported");
  Held held{rdt::AcquireGroup(s.group)};
  if (held.g == nullptr)
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      "rdmatensor: the shm all-reduce group '" + s.group +
                          "' is not open in this process (closed, or never made); all-reduce of " + s.label +
                          " cannot run");
  std::vector<char> packed(total);
  size_t at = 0;
  for (auto& a : in) {
    if (a.size_bytes() > 0) std::memcpy(packed.data() + at, a.untyped_data(), a.size_bytes());
    at += a.size_bytes();
  }
  char err[RDT_SHM_MESSAGE] = {0};
  const int status = rdt_shm_group_allreduce(held.g, s.bucket, packed.data(), packed.data(), elements, dtype,
                                             s.op, s.scale, s.label.c_str(), err, sizeof err);
  if (status != RDT_SHM_OK) return ffi::Error(CodeOf(status), err);
  at = 0;
  for (size_t i = 0; i < n; i++) {
    const size_t bytes = out[i]->size_bytes();
    if (bytes > 0) std::memcpy(out[i]->untyped_data(), packed.data() + at, bytes);
    at += bytes;
  }
  auto next = rets.get<ffi::AnyBuffer>(n);
  if (!next.has_value()) return ffi::Error(ffi::ErrorCode::kInvalidArgument, "rdt_shm_allreduce: no token result");
  *static_cast<int32_t*>((*next)->untyped_data()) = *static_cast<const int32_t*>(token->untyped_data()) + 1;
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER(kRdtShmAllreduce, Allreduce, ffi::Ffi::Bind().RemainingArgs().RemainingRets());

// XLA_FFI_REGISTER_HANDLER discards the registration's error: ops.py checks it.
extern "C" const char* rdt_xla_register() {
  static std::string message;
  static bool done = false;
  static std::mutex mu;
  std::lock_guard<std::mutex> l(mu);
  if (done) return message.c_str();
  done = true;
  const XLA_FFI_Api* api = xla::ffi::GetXlaFfiApi();
  XLA_FFI_Error* e = ffi::Ffi::RegisterStaticHandler(api, "rdt_shm_allreduce", "Host", kRdtShmAllreduce);
  if (e != nullptr) {
    XLA_FFI_Error_GetMessage_Args args{XLA_FFI_Error_GetMessage_Args_STRUCT_SIZE, nullptr, e, nullptr};
    api->XLA_FFI_Error_GetMessage(&args);
    message = args.message;
    XLA_FFI_Error_Destroy_Args d{XLA_FFI_Error_Destroy_Args_STRUCT_SIZE, nullptr, e};
    api->XLA_FFI_Error_Destroy(&d);
  }
  return message.c_str();
}

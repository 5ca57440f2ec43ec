// Spike: an XLA kernel of our own (REGISTER_XLA_OP) for op RdtXlaDouble, which emits
// a typed-FFI custom call to "rdt_ffi_double" (registered by xla_custom_call.cc).
// XlaCustomCallV2 cannot reach an FFI handler: it always emits the legacy API version.
#include "tensorflow/compiler/tf2xla/shape_util.h"
#include "tensorflow/compiler/tf2xla/xla_op_kernel.h"
#include "tensorflow/compiler/tf2xla/xla_op_registry.h"
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "xla/hlo/builder/xla_builder.h"

namespace tensorflow {

REGISTER_OP("RdtXlaDouble")
    .Input("x: float")
    .Output("y: float")
    .SetIsStateful()
    .SetShapeFn(shape_inference::UnchangedShape);

namespace {
class RdtXlaDoubleOp : public XlaOpKernel {
 public:
  explicit RdtXlaDoubleOp(OpKernelConstruction* c) : XlaOpKernel(c) {}
  void Compile(XlaOpKernelContext* ctx) override {
    auto shape = ctx->InputXlaShape(0);
    OP_REQUIRES_OK(ctx, shape.status());
    xla::XlaOp y = xla::CustomCall(ctx->builder(), "rdt_ffi_double", {ctx->Input(0)}, *shape,
                                   /*opaque=*/"", /*has_side_effect=*/true, {}, nullptr,
                                   xla::CustomCallSchedule::SCHEDULE_NONE,
                                   xla::CustomCallApiVersion::API_VERSION_TYPED_FFI);
    ctx->SetOutput(0, y);
  }
};
}  // namespace

REGISTER_XLA_OP(Name("RdtXlaDouble"), RdtXlaDoubleOp);

}  // namespace tensorflow

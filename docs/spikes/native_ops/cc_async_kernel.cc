// Spike: the C++ route (as Horovod builds): an AsyncOpKernel that completes from
// its own thread and listens to the step's CancellationManager.
// Op RdtCcWait(x: float) -> 2 * x after delay_ms, or Cancelled as soon as the step
// is cancelled, or FailedPrecondition when fail is set.
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <thread>

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/shape_inference.h"

using namespace tensorflow;

static std::atomic<long> g_cancelled{0}, g_pending{0}, g_max_pending{0}, g_no_manager{0}, g_calls{0};
extern "C" long rdt_cc_calls() { return g_calls.load(); }
extern "C" long rdt_cc_cancelled() { return g_cancelled.load(); }
extern "C" long rdt_cc_max_pending() { return g_max_pending.load(); }
extern "C" long rdt_cc_no_manager() { return g_no_manager.load(); }
extern "C" void rdt_cc_reset() { g_max_pending = 0; }

// Stateless, so that tf.function's automatic control dependencies do not chain
// them; RdtCcWaitStateful is the same kernel, marked stateful, to show that chaining.
REGISTER_OP("RdtCcWait")
    .Input("x: float")
    .Output("y: float")
    .Attr("delay_ms: int = 0")
    .Attr("fail: bool = false")
    .SetShapeFn(shape_inference::UnchangedShape);
REGISTER_OP("RdtCcWaitStateful")
    .Input("x: float")
    .Output("y: float")
    .Attr("delay_ms: int = 0")
    .Attr("fail: bool = false")
    .SetIsStateful()
    .SetShapeFn(shape_inference::UnchangedShape);

namespace {
struct Waiter {
  std::mutex mu;
  std::condition_variable cv;
  bool cancelled = false;
};

class RdtCcWaitOp : public AsyncOpKernel {
 public:
  explicit RdtCcWaitOp(OpKernelConstruction* c) : AsyncOpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("delay_ms", &delay_ms_));
    OP_REQUIRES_OK(c, c->GetAttr("fail", &fail_));
  }

  void ComputeAsync(OpKernelContext* ctx, DoneCallback done) override {
    ++g_calls;
    long p = ++g_pending, m = g_max_pending.load();
    while (p > m && !g_max_pending.compare_exchange_weak(m, p)) {}
    auto w = std::make_shared<Waiter>();
    CancellationManager* cm = ctx->cancellation_manager();
    CancellationToken token = CancellationManager::kInvalidToken;
    if (cm == nullptr) {
      ++g_no_manager;
    } else {
      token = cm->get_cancellation_token();
      bool registered = cm->RegisterCallback(token, [w] {
        std::lock_guard<std::mutex> l(w->mu);
        w->cancelled = true;
        w->cv.notify_all();
      });
      if (!registered) {
        --g_pending;
        ctx->SetStatus(errors::Cancelled("rdt: step already cancelled"));
        done();
        return;
      }
    }
    // `done` is moved into the thread: TF's own std::function, kept alive by us.
    std::thread([this, ctx, w, cm, token, done = std::move(done)] {
      bool cancelled;
      {
        std::unique_lock<std::mutex> l(w->mu);
        w->cv.wait_for(l, std::chrono::milliseconds(delay_ms_), [&] { return w->cancelled; });
        cancelled = w->cancelled;
      }
      if (cm != nullptr) cm->TryDeregisterCallback(token);
      if (cancelled) {
        ++g_cancelled;
        ctx->SetStatus(errors::Cancelled("rdt: cancelled while waiting"));
      } else if (fail_) {
        ctx->SetStatus(errors::FailedPrecondition("rdt: asked to fail"));
      } else {
        const Tensor& in = ctx->input(0);
        Tensor* out = nullptr;
        OP_REQUIRES_OK_ASYNC(ctx, ctx->allocate_output(0, in.shape(), &out), done);
        auto x = in.flat<float>();
        auto y = out->flat<float>();
        for (int64_t i = 0; i < x.size(); ++i) y(i) = 2 * x(i);
      }
      --g_pending;
      done();
    }).detach();
  }

 private:
  int64_t delay_ms_;
  bool fail_;
};
}  // namespace

REGISTER_KERNEL_BUILDER(Name("RdtCcWait").Device(DEVICE_CPU), RdtCcWaitOp);
REGISTER_KERNEL_BUILDER(Name("RdtCcWaitStateful").Device(DEVICE_CPU), RdtCcWaitOp);

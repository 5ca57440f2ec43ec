// Spike: targets for XLA custom calls on the host platform, registered by our library.
//  - rdt_xla_double: legacy API (XLA_CPU_REGISTER_CUSTOM_CALL_TARGET, the
//    API_VERSION_STATUS_RETURNING_UNIFIED signature that TF's XlaCustomCallV2 emits);
//  - rdt_ffi_double: typed FFI (XLA_FFI_DEFINE_HANDLER / XLA_FFI_REGISTER_HANDLER).
// Both compute y = 2 * x over float32 and count their calls.
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <string>

#include "xla/ffi/api/ffi.h"
#include "xla/service/custom_call_status.h"
#include "xla/service/custom_call_target_registry.h"

namespace xla::ffi {
const XLA_FFI_Api* GetXlaFfiApi();  // exported by libtensorflow_cc.so.2
}

static std::atomic<long> g_legacy{0}, g_ffi{0};
extern "C" long rdt_xla_legacy_calls() { return g_legacy.load(); }
extern "C" long rdt_xla_ffi_calls() { return g_ffi.load(); }

// backend_config carries the element count: the legacy API passes no shapes.
extern "C" void rdt_xla_double(void* out, const void** in, const char* opaque, size_t opaque_len,
                               XlaCustomCallStatus* status) {
  (void)status;  // XlaCustomCallStatusSetFailure is not exported by the wheel
  std::string cfg(opaque, opaque_len);
  long n = std::strtol(cfg.c_str(), nullptr, 10);
  const float* x = static_cast<const float*>(in[0]);
  float* y = static_cast<float*>(out);
  for (long i = 0; i < n; ++i) y[i] = 2 * x[i];
  ++g_legacy;
}
XLA_CPU_REGISTER_CUSTOM_CALL_TARGET_WITH_SYM("rdt_xla_double", rdt_xla_double);

namespace ffi = xla::ffi;
static ffi::Error RdtFfiDouble(ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::F32> y) {
  size_t n = x.element_count();
  for (size_t i = 0; i < n; ++i) y->typed_data()[i] = 2 * x.typed_data()[i];
  ++g_ffi;
  if (n == 0) return ffi::Error(ffi::ErrorCode::kFailedPrecondition, "rdt: empty input");
  return ffi::Error::Success();
}
XLA_FFI_DEFINE_HANDLER(kRdtFfiDouble, RdtFfiDouble,
                       ffi::Ffi::Bind().Arg<ffi::Buffer<ffi::F32>>().Ret<ffi::Buffer<ffi::F32>>());
XLA_FFI_REGISTER_HANDLER(xla::ffi::GetXlaFfiApi(), "rdt_ffi_double", "Host", kRdtFfiDouble);

// The macro above discards the registration's error; this registers the same handler
// under a second name and returns the error message ("" when registered).
extern "C" const char* rdt_ffi_register_checked() {
  static std::string message;
  const XLA_FFI_Api* api = xla::ffi::GetXlaFfiApi();
  XLA_FFI_Error* err = ffi::Ffi::RegisterStaticHandler(api, "rdt_ffi_double_checked", "Host", kRdtFfiDouble);
  if (err == nullptr) return "";
  XLA_FFI_Error_GetMessage_Args args{XLA_FFI_Error_GetMessage_Args_STRUCT_SIZE, nullptr, err, nullptr};
  api->XLA_FFI_Error_GetMessage(&args);
  message = args.message;
  XLA_FFI_Error_Destroy_Args d{XLA_FFI_Error_Destroy_Args_STRUCT_SIZE, nullptr, err};
  api->XLA_FFI_Error_Destroy(&d);
  return message.c_str();
}

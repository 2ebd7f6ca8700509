// The CUDA error table (kernels/cuda_status.h). Needs the CUDA runtime but no
// device: cudaGetErrorName and cudaGetErrorString are tables in the runtime.
#include "kernels/cuda_status.h"

#include <cuda_runtime.h>

#include "absl/status/status.h"
#include "gtest/gtest.h"

namespace specstate {
namespace kernels {
namespace {

TEST(CudaStatusTest, SuccessIsOk) {
  EXPECT_TRUE(CudaStatus(cudaSuccess, "cudaMalloc").ok());
  EXPECT_EQ(CudaStatusCode(cudaSuccess), absl::StatusCode::kOk);
}

TEST(CudaStatusTest, MessageNamesTheCallTheDescriptionAndTheError) {
  const absl::Status s = CudaStatus(cudaErrorIllegalAddress, "cudaMemcpyAsync");
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal);
  EXPECT_EQ(s.message(),
            "cudaMemcpyAsync: an illegal memory access was encountered (cudaErrorIllegalAddress)");
  EXPECT_EQ(DescribeCudaError(cudaErrorMemoryAllocation),
            "out of memory (cudaErrorMemoryAllocation)");
}

TEST(CudaStatusTest, UnknownCodesAreInternalAndNamedByNumber) {
  const auto unknown = static_cast<cudaError_t>(12345);
  const absl::Status s = CudaStatus(unknown, "cudaStreamSynchronize");
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal);
  EXPECT_EQ(s.message(), "cudaStreamSynchronize: unrecognized error code (cudaError 12345)");
}

TEST(CudaStatusTest, Table) {
  const struct {
    cudaError_t error;
    absl::StatusCode code;
  } cases[] = {
      {cudaErrorMemoryAllocation, absl::StatusCode::kResourceExhausted},
      {cudaErrorTooManyPeers, absl::StatusCode::kResourceExhausted},
      {cudaErrorMpsMaxClientsReached, absl::StatusCode::kResourceExhausted},
      {cudaErrorInvalidValue, absl::StatusCode::kInvalidArgument},
      {cudaErrorInvalidDevicePointer, absl::StatusCode::kInvalidArgument},
      {cudaErrorInvalidResourceHandle, absl::StatusCode::kInvalidArgument},
      {cudaErrorInvalidDevice, absl::StatusCode::kInvalidArgument},
      {cudaErrorMapBufferObjectFailed, absl::StatusCode::kInvalidArgument},
      {cudaErrorNoDevice, absl::StatusCode::kUnavailable},
      {cudaErrorInsufficientDriver, absl::StatusCode::kUnavailable},
      {cudaErrorStubLibrary, absl::StatusCode::kUnavailable},
      {cudaErrorDevicesUnavailable, absl::StatusCode::kUnavailable},
      {cudaErrorInitializationError, absl::StatusCode::kUnavailable},
      {cudaErrorLaunchOutOfResources, absl::StatusCode::kInternal},
      {cudaErrorInvalidConfiguration, absl::StatusCode::kInternal},
      {cudaErrorNotSupported, absl::StatusCode::kInternal},
      {cudaErrorUnknown, absl::StatusCode::kInternal},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(cudaGetErrorName(c.error));
    EXPECT_EQ(CudaStatusCode(c.error), c.code);
    EXPECT_EQ(CudaStatus(c.error, "x").code(), c.code);
  }
}

// The errors that leave the context unusable are the device's, never the
// caller's.
TEST(CudaStatusTest, StickyErrorsAreInternal) {
  for (cudaError_t e :
       {cudaErrorIllegalAddress, cudaErrorLaunchTimeout, cudaErrorAssert,
        cudaErrorHardwareStackError, cudaErrorIllegalInstruction, cudaErrorMisalignedAddress,
        cudaErrorInvalidAddressSpace, cudaErrorInvalidPc, cudaErrorLaunchFailure,
        cudaErrorTensorMemoryLeak, cudaErrorContained, cudaErrorECCUncorrectable,
        cudaErrorNvlinkUncorrectable, cudaErrorExternalDevice}) {
    SCOPED_TRACE(cudaGetErrorName(e));
    EXPECT_EQ(CudaStatusCode(e), absl::StatusCode::kInternal);
  }
}

}  // namespace
}  // namespace kernels
}  // namespace specstate

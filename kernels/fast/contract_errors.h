// The errors FAST's accuracy contract compares (docs/semantics.md, "Fast mode
// (FAST): accuracy"): of values against the float64 reference, element-wise
// and norm-wise, and the running maximum of such errors. Shared by the
// accuracy loop (testing/fast_loop) and the simulator's verdict
// (client/simulator/fast_checks), so that both judge alike.
//
// A NaN anywhere makes the error NaN, and a NaN error is never forgotten by
// MaxError: a contract check (`error <= bound`) then fails, as it must for
// an output or state that is not a number.
#ifndef SPECSTATE_KERNELS_FAST_CONTRACT_ERRORS_H_
#define SPECSTATE_KERNELS_FAST_CONTRACT_ERRORS_H_

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace specstate {
namespace kernels {
namespace fast {

// The larger of two errors; NaN if either is.
inline double MaxError(double a, double b) {
  if (std::isnan(a) || std::isnan(b)) return std::numeric_limits<double>::quiet_NaN();
  return std::max(a, b);
}

// max |got - want| / max |want| (the absolute difference where want is all
// zeros); NaN if any difference is.
inline double ElementwiseError(const std::vector<double>& got, const std::vector<double>& want) {
  double worst = 0.0, scale = 0.0;
  for (size_t i = 0; i < want.size(); ++i) {
    worst = MaxError(worst, std::fabs(got[i] - want[i]));
    scale = std::max(scale, std::fabs(want[i]));
  }
  return scale > 0.0 ? worst / scale : worst;
}

// ||got - want|| / ||want|| (the norm of the difference where want is all
// zeros); NaN if any difference is.
inline double NormError(const std::vector<double>& got, const std::vector<double>& want) {
  double diff = 0.0, norm = 0.0;
  for (size_t i = 0; i < want.size(); ++i) {
    diff += (got[i] - want[i]) * (got[i] - want[i]);
    norm += want[i] * want[i];
  }
  return norm > 0.0 ? std::sqrt(diff / norm) : std::sqrt(diff);
}

}  // namespace fast
}  // namespace kernels
}  // namespace specstate

#endif  // SPECSTATE_KERNELS_FAST_CONTRACT_ERRORS_H_

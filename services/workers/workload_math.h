// The workload generator's arithmetic, the same on every IEEE-754 machine:
// exp, log and sin/cos in float64 built from + - * / and exactly specified
// operations (not the platform's libm), and the keyed splitmix64 streams and
// Gaussians every vector of a Workload is drawn from (workload.h).
//
// Internal to the kvkeep_workload target: include it only from that
// target's sources, which are compiled with -ffp-contract=off (no fused
// multiply-add), or the results are no longer bit-identical. Stateless apart
// from SplitMix64 objects; thread-safe.
#ifndef KVKEEP_SERVICES_WORKERS_WORKLOAD_MATH_H_
#define KVKEEP_SERVICES_WORKERS_WORKLOAD_MATH_H_

#include <array>
#include <cmath>
#include <cstdint>
#include <limits>

namespace kvkeep::workers::workload_internal {

// ---------------------------------------------------------------------------
// Deterministic float64 math: only + - * /, sqrt, floor, frexp and ldexp
// (all exactly specified by IEEE 754 / the C standard), so the results do not
// depend on the platform's libm. Accurate to a few ulps, which is plenty; what
// matters is that they are the same everywhere.

inline constexpr double kInvLn2 = 1.44269504088896338700e+00;
inline constexpr double kTwoPi = 6.28318530717958647692e+00;
inline constexpr double kTwoOverPi = 6.36619772367581382433e-01;
// ln 2 and pi/2 split as fdlibm splits them, for the argument reductions.
inline constexpr double kLn2Hi = 6.93147180369123816490e-01;
inline constexpr double kLn2Lo = 1.90821492927058770002e-10;
inline constexpr double kPio2_1 = 1.57079632673412561417e+00;
inline constexpr double kPio2_2 = 6.07710050630396597660e-11;
inline constexpr double kPio2_2t = 2.02226624879595063154e-21;

// 1 / n, and 1 / (n (n - 1)), folded by the compiler (IEEE division, so the
// same constants everywhere); the series below multiply by them.
inline constexpr std::array<double, 24> kInv = [] {
  std::array<double, 24> a{};
  for (int n = 1; n < 24; ++n) a[n] = 1.0 / n;
  return a;
}();
inline constexpr std::array<double, 24> kInvFall2 = [] {
  std::array<double, 24> a{};
  for (int n = 2; n < 24; ++n) a[n] = 1.0 / (n * (n - 1));
  return a;
}();

inline double DetExp(double x) {
  if (x > 709.0) return std::numeric_limits<double>::infinity();
  if (x < -745.0) return 0.0;
  const double k = std::floor(x * kInvLn2 + 0.5);
  const double r = (x - k * kLn2Hi) - k * kLn2Lo;  // |r| <= ~0.347
  double p = 1.0;  // e^r = 1 + r (1 + r/2 (1 + r/3 (...))), to r^15
  for (int n = 15; n >= 1; --n) p = 1.0 + r * p * kInv[n];
  return std::ldexp(p, static_cast<int>(k));
}

// x > 0.
inline double DetLog(double x) {
  int e = 0;
  double m = std::frexp(x, &e);  // x = m * 2^e, m in [0.5, 1)
  if (m < 0.70710678118654752440) {
    m *= 2.0;
    --e;
  }
  // ln m = 2 atanh(s) = 2 (s + s^3/3 + s^5/5 + ...), s = (m - 1) / (m + 1),
  // |s| <= 0.1716.
  const double s = (m - 1.0) / (m + 1.0);
  const double s2 = s * s;
  double p = 0.0;
  for (int n = 23; n >= 3; n -= 2) p = s2 * (kInv[n] + p);
  const double ln_m = 2.0 * s * (1.0 + p);
  return e * kLn2Hi + (e * kLn2Lo + ln_m);
}

inline void DetSinCos(double x, double* sin_out, double* cos_out) {
  const double k = std::floor(x * kTwoOverPi + 0.5);
  const double r = ((x - k * kPio2_1) - k * kPio2_2) - k * kPio2_2t;
  const double r2 = r * r;  // |r| <= ~pi/4
  double s = 1.0;  // sin r = r (1 - r2/3! (1 - r2/(5 4) (...))), to r^19
  for (int n = 19; n >= 3; n -= 2) s = 1.0 - r2 * s * kInvFall2[n];
  s = r * s;
  double c = 1.0;  // cos r = 1 - r2/2! (1 - r2/(4 3) (...)), to r^20
  for (int n = 20; n >= 2; n -= 2) c = 1.0 - r2 * c * kInvFall2[n];
  const int64_t quadrant = static_cast<int64_t>(k) & 3;  // two's complement
  switch (quadrant) {
    case 0:
      *sin_out = s;
      *cos_out = c;
      break;
    case 1:
      *sin_out = c;
      *cos_out = -s;
      break;
    case 2:
      *sin_out = -s;
      *cos_out = -c;
      break;
    default:
      *sin_out = -c;
      *cos_out = s;
      break;
  }
}

// ---------------------------------------------------------------------------
// PRNG: splitmix64 (Steele, Lea, Flood 2014), keyed per stream.

inline uint64_t Mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// What a stream is for: part of its key, so streams never collide.
enum class Stream : uint64_t {
  kKeyNoise = 1,
  kQueryNoise,
  kValue,
  kHeavyHitter,
  kHeavyHitterBonus,
  kLocalityPhase,
  kContentDir,
};

inline uint64_t StreamKey(uint64_t seed, Stream stream, uint64_t layer,
                          uint64_t head, uint64_t index) {
  uint64_t x = Mix64(seed + 0x9E3779B97F4A7C15ull);
  x = Mix64(x ^ (static_cast<uint64_t>(stream) * 0xD1B54A32D192ED03ull));
  x = Mix64(x ^ ((layer + 1) * 0x8CB92BA72F3D8DD7ull));
  x = Mix64(x ^ ((head + 1) * 0xAEF17502108EF2D9ull));
  return Mix64(x ^ ((index + 1) * 0xF1357AEA2E62A9C5ull));
}

class SplitMix64 {
 public:
  explicit SplitMix64(uint64_t key) : state_(key) {}
  uint64_t Next() {
    state_ += 0x9E3779B97F4A7C15ull;
    return Mix64(state_);
  }
  // Uniform in (0, 1): the 53-bit grid shifted by half a step.
  double Uniform() {
    return (static_cast<double>(Next() >> 11) + 0.5) * 0x1.0p-53;
  }

 private:
  uint64_t state_;
};

// out[0..n) = independent standard normals: Box-Muller in Marsaglia's polar
// form (a pair from a point drawn uniformly in the unit disc, no sin/cos).
inline void Gaussians(uint64_t key, double* out, int32_t n) {
  SplitMix64 rng(key);
  for (int32_t i = 0; i < n; i += 2) {
    double u = 0, v = 0, r2 = 0;
    do {
      u = 2.0 * rng.Uniform() - 1.0;
      v = 2.0 * rng.Uniform() - 1.0;
      r2 = u * u + v * v;
    } while (r2 >= 1.0 || r2 == 0.0);
    const double f = std::sqrt(-2.0 * DetLog(r2) / r2);
    out[i] = u * f;
    if (i + 1 < n) out[i + 1] = v * f;
  }
}

inline double UniformAt(uint64_t key) { return SplitMix64(key).Uniform(); }

}  // namespace kvkeep::workers::workload_internal

#endif  // KVKEEP_SERVICES_WORKERS_WORKLOAD_MATH_H_

// Deterministic test data: a value for any tuple of integers, so a test can
// regenerate what it sent and check that a slot holds exactly the token it
// claims to. Header-only; thread-safe.
#ifndef KVKEEP_TESTS_TESTING_NOISE_H_
#define KVKEEP_TESTS_TESTING_NOISE_H_

#include <cstdint>

namespace kvkeep::testing {

// 64 well-mixed bits for (a, b, c, d) (splitmix64's finaliser).
inline uint64_t Mix(uint64_t a, uint64_t b, uint64_t c, uint64_t d) {
  uint64_t x = a * 0x9E3779B97F4A7C15ull + b * 0xBF58476D1CE4E5B9ull +
               c * 0x94D049BB133111EBull + d * 0xD6E8FEB86659FD93ull + 1;
  x ^= x >> 30;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 27;
  x *= 0x94D049BB133111EBull;
  x ^= x >> 31;
  return x;
}

// A deterministic value in [-1, 1) for (a, b, c, d).
inline double Noise(uint64_t a, uint64_t b, uint64_t c, uint64_t d) {
  return static_cast<double>(Mix(a, b, c, d) >> 11) /
             static_cast<double>(1ull << 53) * 2.0 -
         1.0;
}

// The same value rounded to float.
inline float NoiseF(uint64_t a, uint64_t b, uint64_t c, uint64_t d) {
  return static_cast<float>(Noise(a, b, c, d));
}

}  // namespace kvkeep::testing

#endif  // KVKEEP_TESTS_TESTING_NOISE_H_

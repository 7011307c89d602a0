// The plain matrix product a query-scored step is measured against in
// grpc_e2e_bench: q [query_heads x head_dim] x K^T [head_dim x resident] in
// float, hand-written (`omp simd` dot products, as the kernels vectorise
// theirs) or as one OpenBLAS cblas_sgemm.
#ifndef KVKEEP_BENCH_MATMUL_RATE_H_
#define KVKEEP_BENCH_MATMUL_RATE_H_

#include <cstdint>

namespace kvkeep::bench {

enum class MatmulKernel { kOmpSimd, kOpenBlas };

struct MatmulRate {
  double gflop_per_cpu_s = 0;  // thread 0, per second of its CPU time
  double gflop_per_s = 0;      // all threads together, per wall second
};

// Runs the product for `seconds` on `threads` threads, each with its own q
// and K; 2 * rows * depth * resident flops per product. OpenBLAS runs
// single-threaded inside each thread, so a thread's CPU time is its own.
MatmulRate Matmul(MatmulKernel kernel, int32_t rows, int32_t depth,
                  int64_t resident, int threads, double seconds);

// The kernel set OpenBLAS chose for this CPU (openblas_get_corename). On a
// CPU it does not know it falls back to old ones (Debian's 0.3.21 picks
// "Prescott", SSE3, on the Xeon these numbers were measured on; setting
// OPENBLAS_CORETYPE=SkylakeX gives its AVX-512 kernels): print it with
// every rate.
const char* OpenBlasCore();

}  // namespace kvkeep::bench

#endif  // KVKEEP_BENCH_MATMUL_RATE_H_

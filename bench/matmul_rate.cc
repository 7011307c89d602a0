#include "bench/matmul_rate.h"

#include <cblas.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <ctime>
#include <random>
#include <thread>
#include <vector>

namespace kvkeep::bench {
namespace {

using Clock = std::chrono::steady_clock;

double ThreadCpuSeconds() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

// out [rows x resident] = q [rows x depth] x K^T. Blocked by 64 keys (32 KiB
// of K at depth 128) so that a block stays in L1 while the rows pass over it.
void OmpSimdProduct(const float* q, const float* k, float* out, int32_t rows,
                    int32_t depth, int64_t resident) {
  constexpr int64_t kBlock = 64;
  for (int64_t j0 = 0; j0 < resident; j0 += kBlock) {
    const int64_t j1 = std::min(resident, j0 + kBlock);
    for (int32_t h = 0; h < rows; ++h) {
      const float* qh = q + int64_t{h} * depth;
      float* out_h = out + h * resident;
      for (int64_t j = j0; j < j1; ++j) {
        const float* kj = k + j * depth;
        float acc = 0;
#pragma omp simd reduction(+ : acc)
        for (int32_t d = 0; d < depth; ++d) acc += qh[d] * kj[d];
        out_h[j] = acc;
      }
    }
  }
}

void BlasProduct(const float* q, const float* k, float* out, int32_t rows,
                 int32_t depth, int64_t resident) {
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows,
              static_cast<int>(resident), depth, 1.0f, q, depth, k, depth, 0.0f,
              out, static_cast<int>(resident));
}

}  // namespace

MatmulRate Matmul(MatmulKernel kernel, int32_t rows, int32_t depth,
                  int64_t resident, int threads, double seconds) {
  // One thread per product: the comparison is per CPU second.
  openblas_set_num_threads(1);
  const auto product =
      kernel == MatmulKernel::kOpenBlas ? BlasProduct : OmpSimdProduct;
  std::atomic<int64_t> products{0};
  std::atomic<double> thread0_cpu_s{0};
  std::atomic<int64_t> thread0_products{0};
  const Clock::time_point end =
      Clock::now() + std::chrono::duration_cast<Clock::duration>(
                         std::chrono::duration<double>(seconds));
  auto worker = [&](int index) {
    std::mt19937 rng(index + 1);
    std::normal_distribution<float> normal;
    std::vector<float> q(int64_t{rows} * depth);
    std::vector<float> k(resident * depth);
    std::vector<float> out(rows * resident);
    for (float& x : q) x = normal(rng);
    for (float& x : k) x = normal(rng);
    const double cpu0 = ThreadCpuSeconds();
    int64_t done = 0;
    while (Clock::now() < end) {
      product(q.data(), k.data(), out.data(), rows, depth, resident);
      ++done;
    }
    // Keeps the products observable so the loop is not optimised away.
    volatile float sink = out[done % out.size()];
    (void)sink;
    products += done;
    if (index == 0) {
      thread0_cpu_s = ThreadCpuSeconds() - cpu0;
      thread0_products = done;
    }
  };
  std::vector<std::thread> pool;
  const Clock::time_point start = Clock::now();
  for (int t = 0; t < threads; ++t) pool.emplace_back(worker, t);
  for (std::thread& t : pool) t.join();
  const double elapsed =
      std::chrono::duration<double>(Clock::now() - start).count();
  const double flops = 2.0 * rows * depth * resident;
  return MatmulRate{
      flops * static_cast<double>(thread0_products.load()) /
          thread0_cpu_s.load() / 1e9,
      flops * static_cast<double>(products.load()) / elapsed / 1e9};
}

double SgemmGqaGflopPerCpuS(int32_t layers, int32_t kv_heads, int32_t group,
                            int32_t depth, int64_t resident, double seconds) {
  openblas_set_num_threads(1);
  std::mt19937 rng(7);
  std::normal_distribution<float> normal;
  const int64_t heads = int64_t{layers} * kv_heads;
  std::vector<float> q(heads * group * depth);
  std::vector<float> k(heads * resident * depth);
  std::vector<float> out(group * resident);
  for (float& x : q) x = normal(rng);
  for (float& x : k) x = normal(rng);
  const int n = static_cast<int>(resident);
  const double cpu0 = ThreadCpuSeconds();
  int64_t steps = 0;
  do {
    for (int64_t h = 0; h < heads; ++h) {
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, group, n, depth,
                  1.0f, q.data() + h * group * depth, depth,
                  k.data() + h * resident * depth, depth, 0.0f, out.data(), n);
    }
    ++steps;
  } while (ThreadCpuSeconds() - cpu0 < seconds);
  volatile float sink = out[steps % out.size()];
  (void)sink;
  const double flops = 2.0 * heads * group * depth * resident;
  return flops * static_cast<double>(steps) / (ThreadCpuSeconds() - cpu0) / 1e9;
}

const char* OpenBlasCore() { return openblas_get_corename(); }

}  // namespace kvkeep::bench

// The forward pass's building blocks (services/lm/model_ops.h), each
// against a naive twin in double precision, over awkward sizes; and the
// task pool the forward pass runs on.
#include "services/lm/model_ops.h"

#include <algorithm>
#include <cmath>
#include <random>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "tests/lm/model_testing.h"

namespace kvkeep::lm {
namespace {

using internal::GroupAttentionArgs;

// ---- Building blocks ----

TEST(ModelOpsTest, ExpIsWithinTwoUlpOfLibm) {
  for (float x = -87.0f; x <= 88.0f; x += 0.001953125f) {
    const double want = std::exp(static_cast<double>(x));
    ASSERT_NEAR(internal::FastExp(x), want, want * 2.5e-7) << "x = " << x;
  }
  EXPECT_EQ(internal::FastExp(0.0f), 1.0f);
  EXPECT_LT(internal::FastExp(-1000.0f), 1e-37f);
  EXPECT_TRUE(std::isfinite(internal::FastExp(1000.0f)));
}

TEST(ModelOpsTest, HalfToFloatMatchesTheExactConversionForEveryValue) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const float got = internal::HalfToFloat(static_cast<uint16_t>(h));
    const float want = F16ToFloat(static_cast<uint16_t>(h));
    ASSERT_EQ(std::bit_cast<uint32_t>(got), std::bit_cast<uint32_t>(want))
        << "h = " << h;
  }
}

TEST(ModelOpsTest, ToFloatReadsEveryDTypeExactly) {
  std::mt19937 rng(1);
  const std::vector<float> v = RandomVector(77, 3.0f, rng);
  for (DType t : {DType::kF32, DType::kF16, DType::kBF16}) {
    std::vector<std::byte> bytes(v.size() * DTypeBytes(t));
    for (size_t i = 0; i < v.size(); ++i)
      StoreFromFloat(t, bytes.data(), i, v[i]);
    std::vector<float> out(v.size());
    internal::ToFloat(t, bytes.data(), static_cast<int64_t>(v.size()),
                      out.data());
    for (size_t i = 0; i < v.size(); ++i) {
      ASSERT_EQ(out[i], LoadAsFloat(t, bytes.data(), i)) << DTypeName(t);
    }
  }
}

TEST(ModelOpsTest, RmsNormAndSwiGluMatchNaive) {
  std::mt19937 rng(2);
  for (int32_t dim : {1, 7, 64, 576}) {
    const int64_t rows = 3;
    const std::vector<float> x = RandomVector(rows * dim, 2.0f, rng);
    const std::vector<float> w = RandomVector(dim, 1.0f, rng);
    std::vector<float> out(x.size());
    internal::RmsNorm(x.data(), w.data(), rows, dim, 1e-5f, out.data());
    for (int64_t r = 0; r < rows; ++r) {
      double ss = 0;
      for (int32_t d = 0; d < dim; ++d)
        ss += double{x[r * dim + d]} * x[r * dim + d];
      const double inv = 1.0 / std::sqrt(ss / dim + 1e-5);
      for (int32_t d = 0; d < dim; ++d) {
        const double want = x[r * dim + d] * inv * w[d];
        ASSERT_NEAR(out[r * dim + d], want, 1e-5 * (1 + std::abs(want)));
      }
    }
    const std::vector<float> up = RandomVector(dim, 1.0f, rng);
    std::vector<float> act(dim);
    internal::SwiGlu(x.data(), up.data(), dim, act.data());
    for (int32_t d = 0; d < dim; ++d) {
      const double g = x[d];
      const double want = g / (1 + std::exp(-g)) * up[d];
      ASSERT_NEAR(act[d], want, 1e-6 * (1 + std::abs(want)));
    }
  }
}

TEST(ModelOpsTest, RopeRotatesAdjacentPairsAndTheTableChangesNothing) {
  std::mt19937 rng(3);
  for (int32_t hd : {2, 8, 64, 80, 128}) {
    const internal::RopeTable tabulated(hd, 100000.0f, 64);
    const internal::RopeTable computed(hd, 100000.0f, 0);
    for (int64_t pos : {0, 1, 5, 63, 64, 1000, 8191}) {
      const std::vector<float> x = RandomVector(2 * hd, 1.0f, rng);
      std::vector<float> a = x, b = x;
      tabulated.Rotate(pos, 2, a.data());
      computed.Rotate(pos, 2, b.data());
      ASSERT_EQ(a, b) << "hd " << hd << " pos " << pos;
      for (int32_t h = 0; h < 2; ++h) {
        for (int32_t i = 0; i < hd / 2; ++i) {
          const double angle = pos * std::pow(100000.0, -2.0 * i / hd);
          const double x0 = x[h * hd + 2 * i], x1 = x[h * hd + 2 * i + 1];
          // float32 angles, as Hugging Face forms them: ~pos * 6e-8 rad off.
          const double tol = 1e-6 + 4e-7 * pos;
          ASSERT_NEAR(a[h * hd + 2 * i],
                      x0 * std::cos(angle) - x1 * std::sin(angle), tol);
          ASSERT_NEAR(a[h * hd + 2 * i + 1],
                      x0 * std::sin(angle) + x1 * std::cos(angle), tol);
        }
      }
    }
  }
}

// Naive causal attention of one query head: probabilities and output.
void NaiveHead(const float* q, const std::vector<float>& keys,
               const std::vector<float>& values, int32_t hd, int64_t visible,
               std::vector<double>* probs, std::vector<double>* out) {
  probs->assign(visible, 0);
  double max = -1e300;
  for (int64_t s = 0; s < visible; ++s) {
    double dot = 0;
    for (int32_t d = 0; d < hd; ++d) dot += double{q[d]} * keys[s * hd + d];
    (*probs)[s] = dot / std::sqrt(double{1.0 * hd});
    max = std::max(max, (*probs)[s]);
  }
  double sum = 0;
  for (double& p : *probs) sum += (p = std::exp(p - max));
  out->assign(hd, 0);
  for (int64_t s = 0; s < visible; ++s) {
    (*probs)[s] /= sum;
    for (int32_t d = 0; d < hd; ++d)
      (*out)[d] += (*probs)[s] * values[s * hd + d];
  }
}

// Both forms of the attention against NaiveHead: head dims 8, 64, 80;
// groups 1, 3, 5, 16 (blocks of 12 vectors split a token's heads); caches
// of 0 to 1100 resident slots (three streaming chunks) in pages of 3 (and
// float16); steps of 1 to 17 tokens, run as two calls over [0, n/2) and
// [n/2, n) as tasks split them. The streaming form only where its vectors
// fit one block, as the model uses it.
TEST(ModelOpsTest, AttentionMatchesNaiveOverAwkwardSizes) {
  std::mt19937 rng(4);
  for (int32_t hd : {8, 64, 80}) {
    for (int32_t group : {1, 3, 5, 16}) {
      for (int64_t resident : {0, 1, 7, 33, 1100}) {
        for (int64_t n : {1, 5, 17}) {
          for (DType dtype : {DType::kF32, DType::kF16}) {
            if (resident > 100 && (hd != 64 || n > 5)) continue;  // time
            const int64_t total = resident + n;
            const int32_t page_tokens = 3;
            const int64_t pages = (resident + page_tokens - 1) / page_tokens;
            const int64_t head_bytes = hd * DTypeBytes(dtype);
            // One kv head of two (the second one's bytes sit between).
            const int64_t token_bytes = 2 * head_bytes;
            std::vector<float> keys = RandomVector(total * hd, 1.0f, rng);
            std::vector<float> values = RandomVector(total * hd, 1.0f, rng);
            std::vector<std::byte> arena((pages + 1) * 2 * page_tokens *
                                         token_bytes);
            std::vector<std::byte> new_keys(n * token_bytes),
                new_values(n * token_bytes);
            std::vector<int32_t> page_ids(pages);
            for (int64_t p = 0; p < pages; ++p)
              page_ids[p] = static_cast<int32_t>(pages - p);
            internal::SlotSource slots;
            slots.dtype = dtype;
            slots.head_dim = hd;
            slots.arena = arena.data();
            slots.pages = page_ids.data();
            slots.page_tokens = page_tokens;
            slots.page_bytes = 2 * page_tokens * token_bytes;
            slots.token_bytes = token_bytes;
            slots.head_offset = head_bytes;
            slots.resident = resident;
            slots.new_keys = new_keys.data();
            slots.new_values = new_values.data();
            for (int64_t s = 0; s < total; ++s) {
              auto* k = const_cast<std::byte*>(slots.KeyBytes(s));
              auto* v = const_cast<std::byte*>(slots.ValueBytes(s));
              for (int32_t d = 0; d < hd; ++d) {
                StoreFromFloat(dtype, k, d, keys[s * hd + d]);
                keys[s * hd + d] = LoadAsFloat(dtype, k, d);
                StoreFromFloat(dtype, v, d, values[s * hd + d]);
                values[s * hd + d] = LoadAsFloat(dtype, v, d);
              }
            }
            std::vector<float> tiled_keys(internal::KeyFloats(total, hd), NAN);
            std::vector<float> padded_values(total * internal::ValueStride(hd),
                                             NAN);
            internal::GatherSlots(slots, total, tiled_keys.data(),
                                  padded_values.data());
            const std::vector<float> q =
                RandomVector(n * group * hd, 1.0f, rng);
            for (bool tiled : {false, true}) {
              if (!tiled && (n - n / 2) * group > internal::kMaxVecs) continue;
              std::vector<float> out(n * group * hd, -1.0f);
              std::vector<float> probs(group * n * total, -1.0f);
              for (auto [first, last] :
                   {std::pair{int64_t{0}, n / 2}, std::pair{n / 2, n}}) {
                GroupAttentionArgs a;
                a.head_dim = hd;
                a.group = group;
                a.resident = resident;
                a.n = n;
                a.first = first;
                a.last = last;
                a.scale = 1.0f / std::sqrt(static_cast<float>(hd));
                a.q = q.data();
                a.q_stride = group * hd;
                a.out = out.data();
                a.out_stride = group * hd;
                a.probs = probs.data();
                a.probs_head_stride = n * total;
                if (tiled) {
                  internal::TiledAttention(a, tiled_keys.data(),
                                           padded_values.data());
                } else {
                  internal::StreamingAttention(a, slots);
                }
              }
              std::vector<double> p, o;
              for (int64_t i = 0; i < n; ++i) {
                for (int32_t j = 0; j < group; ++j) {
                  NaiveHead(&q[(i * group + j) * hd], keys, values, hd,
                            resident + i + 1, &p, &o);
                  for (int64_t s = 0; s < total; ++s) {
                    const double want = s < resident + i + 1 ? p[s] : 0.0;
                    ASSERT_NEAR(probs[(j * n + i) * total + s], want, 2e-6);
                  }
                  for (int32_t d = 0; d < hd; ++d) {
                    ASSERT_NEAR(out[(i * group + j) * hd + d], o[d], 2e-5)
                        << "tiled " << tiled << " hd " << hd << " group "
                        << group << " resident " << resident << " n " << n
                        << " " << DTypeName(dtype);
                  }
                }
              }
            }
          }
        }
      }
    }
  }
}

TEST(TaskPoolTest, RunsEveryItemOnceAlsoWithConcurrentCallers) {
  internal::TaskPool pool(4);
  EXPECT_EQ(pool.threads(), 4);
  pool.ParallelFor(0, [](int64_t) { FAIL() << "no items"; });
  auto check = [&pool](int64_t count) {
    std::vector<std::atomic<int>> hits(count);
    for (int round = 0; round < 50; ++round) {
      pool.ParallelFor(count, [&](int64_t i) { hits[i].fetch_add(1); });
    }
    for (int64_t i = 0; i < count; ++i) ASSERT_EQ(hits[i].load(), 50);
  };
  std::thread other(check, 37);
  check(101);
  other.join();
}

}  // namespace
}  // namespace kvkeep::lm

// SnapKV's 1-D pooling along the sequence and page-score aggregation: CPU
// references. Thread-safe (no shared state).
#ifndef KVKEEP_KERNELS_POOLING_H_
#define KVKEEP_KERNELS_POOLING_H_

#include <cstdint>
#include <span>

namespace kvkeep {

enum class Pooling : uint8_t { kMax, kAvg };

// out[i] = pool over in[i - kernel/2 .. i + kernel/2] with stride 1 and
// padding kernel/2, as torch's max_pool1d / avg_pool1d do: max pooling pads
// with -inf; average pooling counts the zero padding (count_include_pad), so
// every window is divided by `kernel`. `kernel` must be odd so that out has
// the length of in.
void Pool1d(std::span<const float> in, int32_t kernel, Pooling pooling,
            std::span<float> out);

}  // namespace kvkeep

#endif  // KVKEEP_KERNELS_POOLING_H_

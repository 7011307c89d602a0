#include "services/lm/kv_caches.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace kvkeep::lm {

SlotCache::SlotCache(int32_t layers, int64_t token_bytes)
    : token_bytes_(token_bytes), layers_(layers) {}

ResidentKv SlotCache::Layer(int32_t layer) const {
  const LayerSlots& l = layers_[layer];
  ResidentKv view;
  view.arena = l.bytes.data();
  view.pages = absl::MakeConstSpan(&l.page, 1);
  view.page_tokens = static_cast<int32_t>(std::max<int64_t>(l.capacity, 1));
  view.page_bytes = 2 * l.capacity * token_bytes_;
  view.resident = static_cast<int64_t>(l.positions.size());
  view.positions = l.positions;
  return view;
}

const std::byte* SlotCache::key(int32_t layer, int64_t slot) const {
  return layers_[layer].bytes.data() + slot * token_bytes_;
}

const std::byte* SlotCache::value(int32_t layer, int64_t slot) const {
  const LayerSlots& l = layers_[layer];
  return l.bytes.data() + (l.capacity + slot) * token_bytes_;
}

void SlotCache::Reserve(LayerSlots& layer, int64_t tokens) {
  if (tokens <= layer.capacity) return;
  const int64_t capacity = std::max<int64_t>(tokens, 2 * layer.capacity);
  std::vector<std::byte> bytes(2 * capacity * token_bytes_);
  const int64_t used = static_cast<int64_t>(layer.positions.size());
  if (used > 0) {
    std::memcpy(bytes.data(), layer.bytes.data(), used * token_bytes_);
    std::memcpy(bytes.data() + capacity * token_bytes_,
                layer.bytes.data() + layer.capacity * token_bytes_,
                used * token_bytes_);
  }
  layer.bytes = std::move(bytes);
  layer.capacity = capacity;
}

void SlotCache::Place(LayerSlots& layer, int64_t slot, int64_t position,
                      const std::byte* key, const std::byte* value) {
  std::memcpy(layer.bytes.data() + slot * token_bytes_, key, token_bytes_);
  std::memcpy(layer.bytes.data() + (layer.capacity + slot) * token_bytes_,
              value, token_bytes_);
  layer.positions[slot] = position;
}

namespace {

absl::Status CheckNewTokens(int32_t layers, int64_t token_bytes,
                            absl::Span<const int64_t> positions,
                            absl::Span<const std::string> keys,
                            absl::Span<const std::string> values) {
  if (positions.empty()) return absl::OkStatus();
  const size_t bytes = positions.size() * token_bytes;
  if (keys.size() != static_cast<size_t>(layers) ||
      values.size() != static_cast<size_t>(layers)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "new tokens for ", keys.size(), " layers, the cache has ", layers));
  }
  for (int32_t l = 0; l < layers; ++l) {
    if (keys[l].size() != bytes || values[l].size() != bytes) {
      return absl::InvalidArgumentError(absl::StrCat(
          "layer ", l, ": ", keys[l].size(), " key and ", values[l].size(),
          " value bytes for ", positions.size(), " tokens of ", token_bytes));
    }
  }
  return absl::OkStatus();
}

const std::byte* Bytes(const std::string& s, int64_t offset) {
  return reinterpret_cast<const std::byte*>(s.data()) + offset;
}

}  // namespace

absl::Status SlotCache::Apply(const v1::StepResult& result,
                              absl::Span<const int64_t> positions,
                              absl::Span<const std::string> keys,
                              absl::Span<const std::string> values) {
  if (absl::Status s =
          CheckNewTokens(num_layers(), token_bytes_, positions, keys, values);
      !s.ok()) {
    return s;
  }
  if (result.layers_size() != num_layers()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a result of ", result.layers_size(), " layers for ", num_layers()));
  }
  // Per layer, which of the new tokens it kept (in position order).
  std::vector<std::vector<int64_t>> kept(num_layers());
  for (int32_t l = 0; l < num_layers(); ++l) {
    const v1::LayerChange& c = result.layers(l);
    const int64_t size = resident(l);
    for (size_t i = 0; i < positions.size(); ++i) {
      if (!std::binary_search(c.evicted_positions().begin(),
                              c.evicted_positions().end(), positions[i])) {
        kept[l].push_back(static_cast<int64_t>(i));
      }
    }
    const int64_t kept_old =
        c.resident() - static_cast<int64_t>(kept[l].size());
    if (c.layer() != l || kept_old < 0 || kept_old > size) {
      return absl::InvalidArgumentError(
          absl::StrCat("layer ", l, ": resident ", c.resident(), " with ",
                       kept[l].size(), " kept new tokens from ", size));
    }
    for (const v1::SlotMove& m : c.moves()) {
      if (m.from_slot() < 0 || m.from_slot() >= size || m.to_slot() < 0 ||
          m.to_slot() >= size) {
        return absl::InvalidArgumentError(
            absl::StrCat("layer ", l, ": move ", m.from_slot(), " -> ",
                         m.to_slot(), " outside the ", size, " slots"));
      }
    }
  }
  for (int32_t l = 0; l < num_layers(); ++l) {
    const v1::LayerChange& c = result.layers(l);
    LayerSlots& layer = layers_[l];
    for (const v1::SlotMove& m : c.moves()) {
      Place(layer, m.to_slot(), layer.positions[m.from_slot()],
            key(l, m.from_slot()), value(l, m.from_slot()));
    }
    const int64_t first = c.resident() - static_cast<int64_t>(kept[l].size());
    Reserve(layer, c.resident());
    layer.positions.resize(c.resident());
    for (size_t j = 0; j < kept[l].size(); ++j) {
      const int64_t i = kept[l][j];
      Place(layer, first + static_cast<int64_t>(j), positions[i],
            Bytes(keys[l], i * token_bytes_),
            Bytes(values[l], i * token_bytes_));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<MappedPool>> MappedPool::Map(
    const v1::MapPoolResponse& response) {
  if (response.handle_case() != v1::MapPoolResponse::kShmName) {
    return absl::FailedPreconditionError(
        absl::StrCat("the pool of layout ", response.layout().name(), " is on ",
                     response.device(),
                     ": kvkeep-lm maps host pools only (run without "
                     "--map_pool to mirror the cache instead)"));
  }
  const int fd = shm_open(response.shm_name().c_str(), O_RDONLY, 0);
  if (fd < 0) {
    return absl::UnavailableError(absl::StrCat(
        "shm_open(", response.shm_name(), "): ", std::strerror(errno),
        " (is kvkeepd on this machine, started with --share_pools?)"));
  }
  void* base =
      mmap(nullptr, response.arena_bytes(), PROT_READ, MAP_SHARED, fd, 0);
  const int mmap_errno = errno;
  close(fd);
  if (base == MAP_FAILED) {
    return absl::UnavailableError(
        absl::StrCat("mmap of ", response.arena_bytes(), " bytes of ",
                     response.shm_name(), ": ", std::strerror(mmap_errno)));
  }
  auto pool = std::unique_ptr<MappedPool>(new MappedPool());
  pool->arena_ = static_cast<const std::byte*>(base);
  pool->arena_bytes_ = response.arena_bytes();
  pool->page_bytes_ = response.layout().page_bytes();
  pool->page_tokens_ = response.layout().page_tokens();
  pool->capacity_pages_ = response.capacity_pages();
  if (pool->page_bytes_ <= 0 || pool->page_tokens_ <= 0 ||
      pool->capacity_pages_ * pool->page_bytes_ > pool->arena_bytes_) {
    return absl::InvalidArgumentError(absl::StrCat(
        "MapPool describes ", pool->capacity_pages_, " pages of ",
        pool->page_bytes_, " bytes in an arena of ", pool->arena_bytes_));
  }
  return pool;
}

MappedPool::~MappedPool() {
  munmap(const_cast<std::byte*>(arena_), arena_bytes_);
}

absl::Status MappedPool::CheckPages(
    const client::BlockTableMirror& mirror) const {
  for (int32_t l = 0; l < mirror.num_layers(); ++l) {
    for (int32_t page : mirror.pages(l)) {
      if (page < 0 || page >= capacity_pages_) {
        return absl::OutOfRangeError(absl::StrCat("layer ", l, " names page ",
                                                  page, " of a pool of ",
                                                  capacity_pages_));
      }
    }
  }
  return absl::OkStatus();
}

ResidentKv MappedPool::Layer(const client::BlockTableMirror& mirror,
                             int32_t layer) const {
  ResidentKv view;
  view.arena = arena_;
  view.pages = mirror.pages(layer);
  view.page_tokens = page_tokens_;
  view.page_bytes = page_bytes_;
  view.resident = mirror.resident(layer);
  view.positions = mirror.positions(layer);
  return view;
}

}  // namespace kvkeep::lm

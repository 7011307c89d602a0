// BlockTableMirror (declared in kvkeep_client.h): a worker's copy of a
// session's block tables, checked against and then changed by each call's
// LayerChanges. Pure bookkeeping over the proto messages: no RPC here.
#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"
#include "services/client/kvkeep_client.h"

namespace kvkeep::client {

BlockTableMirror::BlockTableMirror(int32_t page_tokens,
                                   absl::Span<const uint64_t> versions)
    : page_tokens_(page_tokens), layers_(versions.size()) {
  for (size_t l = 0; l < versions.size(); ++l) {
    layers_[l].version = versions[l];
  }
}

absl::StatusOr<BlockTableMirror> BlockTableMirror::FromTables(
    const v1::GetBlockTablesResponse& tables) {
  if (tables.tables_size() == 0) {
    return absl::InvalidArgumentError("no block tables to mirror");
  }
  BlockTableMirror mirror(tables.tables(0).page_tokens());
  for (int l = 0; l < tables.tables_size(); ++l) {
    const v1::BlockTable& t = tables.tables(l);
    if (t.layer() != l) {
      return absl::InvalidArgumentError(
          absl::StrCat("block table ", l, " is of layer ", t.layer(),
                       ": a mirror needs every layer, in layer order"));
    }
    mirror.layers_.push_back(
        Layer{t.version(),
              {t.pages().begin(), t.pages().end()},
              {t.positions().begin(), t.positions().end()}});
  }
  return mirror;
}

namespace {

// The call's new tokens that a layer kept: new_positions minus the evicted
// ones (both ascending).
int64_t KeptNew(absl::Span<const int64_t> new_positions,
                const google::protobuf::RepeatedField<int64_t>& evicted) {
  int64_t kept = 0;
  for (int64_t p : new_positions) {
    kept += std::binary_search(evicted.begin(), evicted.end(), p) ? 0 : 1;
  }
  return kept;
}

}  // namespace

absl::Status BlockTableMirror::Check(
    const v1::StepResult& result,
    absl::Span<const int64_t> new_positions) const {
  if (result.layers_size() != num_layers()) {
    return absl::InvalidArgumentError(
        absl::StrCat("a result of ", result.layers_size(),
                     " layers for a mirror of ", num_layers()));
  }
  for (int32_t l = 0; l < num_layers(); ++l) {
    const v1::LayerChange& c = result.layers(l);
    const Layer& layer = layers_[l];
    const int64_t size = static_cast<int64_t>(layer.positions.size());
    const auto where = [&] { return absl::StrCat("layer ", l, ": "); };
    if (c.layer() != l) {
      return absl::InvalidArgumentError(
          absl::StrCat(where(), "the result names layer ", c.layer()));
    }
    for (const v1::SlotMove& m : c.moves()) {
      if (m.from_slot() < 0 || m.from_slot() >= size || m.to_slot() < 0 ||
          m.to_slot() >= size) {
        return absl::InvalidArgumentError(
            absl::StrCat(where(), "move ", m.from_slot(), " -> ", m.to_slot(),
                         " outside the ", size, " resident slots"));
      }
    }
    const int64_t kept_old =
        c.resident() - KeptNew(new_positions, c.evicted_positions());
    if (kept_old < 0 || kept_old > size) {
      return absl::InvalidArgumentError(
          absl::StrCat(where(), "resident ", c.resident(), " with ",
                       new_positions.size(), " new tokens from ", size));
    }
    const int64_t pages = static_cast<int64_t>(layer.pages.size());
    for (const v1::PageCopy& copy : c.pages_copied()) {
      if (copy.index() < 0 || copy.index() >= pages ||
          layer.pages[copy.index()] != copy.from_page()) {
        return absl::InvalidArgumentError(absl::StrCat(
            where(), "a copy of page ", copy.from_page(), " at index ",
            copy.index(), " that the table does not hold there"));
      }
    }
    const int64_t freed = c.pages_freed_size();
    if (freed > pages ||
        !std::is_permutation(c.pages_freed().begin(), c.pages_freed().end(),
                             layer.pages.end() - freed)) {
      return absl::InvalidArgumentError(absl::StrCat(
          where(), "the ", freed, " freed pages are not the last of ", pages));
    }
    if ((pages - freed + c.pages_added_size()) * page_tokens_ < c.resident()) {
      return absl::InvalidArgumentError(
          absl::StrCat(where(), pages - freed + c.pages_added_size(),
                       " pages cannot hold ", c.resident(), " tokens"));
    }
  }
  return absl::OkStatus();
}

absl::Status BlockTableMirror::Apply(const v1::StepResult& result,
                                     absl::Span<const int64_t> new_positions) {
  if (absl::Status s = Check(result, new_positions); !s.ok()) return s;
  for (int32_t l = 0; l < num_layers(); ++l) {
    const v1::LayerChange& c = result.layers(l);
    Layer& layer = layers_[l];
    for (const v1::PageCopy& copy : c.pages_copied()) {
      layer.pages[copy.index()] = copy.to_page();
    }
    for (const v1::SlotMove& m : c.moves()) {
      layer.positions[m.to_slot()] = layer.positions[m.from_slot()];
    }
    const int64_t kept_new = KeptNew(new_positions, c.evicted_positions());
    layer.positions.resize(c.resident() - kept_new);
    layer.pages.resize(layer.pages.size() - c.pages_freed_size());
    layer.pages.insert(layer.pages.end(), c.pages_added().begin(),
                       c.pages_added().end());
    for (int64_t p : new_positions) {
      if (!std::binary_search(c.evicted_positions().begin(),
                              c.evicted_positions().end(), p)) {
        layer.positions.push_back(p);
      }
    }
    layer.version = c.version();
  }
  return absl::OkStatus();
}

absl::Status BlockTableMirror::ApplyDecode(
    const v1::DecodeStepResult& result,
    absl::Span<const int64_t> new_positions) {
  if (result.has_append()) {
    if (absl::Status s = Apply(result.append(), new_positions); !s.ok()) {
      return s;
    }
  } else if (!new_positions.empty()) {
    return absl::InvalidArgumentError(
        "new positions given for a decode step that appended nothing");
  }
  return Apply(result.scores());
}

absl::Status BlockTableMirror::ApplyPrefill(
    const PrefillResult& result, absl::Span<const int64_t> positions) {
  int64_t first = 0;
  for (size_t c = 0; c < result.chunks.size(); ++c) {
    const int64_t n = result.chunk_tokens[c];
    if (first + n > static_cast<int64_t>(positions.size())) {
      return absl::InvalidArgumentError(
          absl::StrCat("the prefill's chunks hold more than the ",
                       positions.size(), " positions given"));
    }
    if (absl::Status s = Apply(result.chunks[c], positions.subspan(first, n));
        !s.ok()) {
      return s;
    }
    first += n;
  }
  return absl::OkStatus();
}

std::vector<int64_t> BlockTableMirror::CachePositions(int32_t layer) const {
  const std::vector<int64_t>& positions = layers_[layer].positions;
  std::vector<int64_t> order(positions.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int64_t>(i);
  std::sort(order.begin(), order.end(),
            [&](int64_t a, int64_t b) { return positions[a] < positions[b]; });
  std::vector<int64_t> rank(positions.size());
  for (size_t r = 0; r < order.size(); ++r) {
    rank[order[r]] = static_cast<int64_t>(r);
  }
  return rank;
}

v1::BlockTable BlockTableMirror::Table(int32_t layer) const {
  const Layer& l = layers_[layer];
  v1::BlockTable table;
  table.set_layer(layer);
  table.set_version(l.version);
  table.set_page_tokens(page_tokens_);
  table.mutable_pages()->Add(l.pages.begin(), l.pages.end());
  table.mutable_positions()->Add(l.positions.begin(), l.positions.end());
  const std::vector<int64_t> cache = CachePositions(layer);
  table.mutable_cache_positions()->Add(cache.begin(), cache.end());
  return table;
}

}  // namespace kvkeep::client

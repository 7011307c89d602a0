#include "services/kvkeepd/block_table_pages.h"

#include <algorithm>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "cache_store/quote.h"

namespace kvkeep {
namespace {

// Where a page starts: the index into the request's layers, the slot in
// that layer, and (when the slot is not 0) the layer's version, which the
// rest of the split table must still have.
struct Cursor {
  size_t index = 0;
  int64_t slot = 0;
  uint64_t version = 0;
};

// "bt1:INDEX:SLOT:VERSION": opaque to callers.
std::string TokenOf(const Cursor& c) {
  return absl::StrCat("bt1:", c.index, ":", c.slot, ":", c.version);
}

absl::StatusOr<Cursor> CursorOf(const std::string& token, size_t layers) {
  if (token.empty()) return Cursor{};
  const std::vector<std::string> parts = absl::StrSplit(token, ':');
  Cursor c;
  if (parts.size() != 4 || parts[0] != "bt1" ||
      !absl::SimpleAtoi(parts[1], &c.index) ||
      !absl::SimpleAtoi(parts[2], &c.slot) ||
      !absl::SimpleAtoi(parts[3], &c.version) || c.index >= layers ||
      c.slot < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("page_token ", Quote(token),
                     " is not one GetBlockTables gave for these layers"));
  }
  return c;
}

// Slots [first, first + n) of `table`, with the pages that hold them
// (`first` is a multiple of page_tokens).
void PartToProto(const BlockTable& table, int64_t first, int64_t n,
                 v1::BlockTable* out) {
  out->set_layer(table.layer);
  out->set_version(table.version);
  out->set_page_tokens(table.page_tokens);
  out->set_first_slot(first);
  const int64_t pt = table.page_tokens;
  const int64_t first_page = first / pt;
  const int64_t end_page = std::min<int64_t>(
      (first + n + pt - 1) / pt, static_cast<int64_t>(table.pages.size()));
  out->mutable_pages()->Add(table.pages.begin() + first_page,
                            table.pages.begin() + end_page);
  out->mutable_positions()->Add(table.positions.begin() + first,
                                table.positions.begin() + first + n);
  out->mutable_cache_positions()->Add(
      table.cache_positions.begin() + first,
      table.cache_positions.begin() + first + n);
}

}  // namespace

absl::Status FillBlockTablePage(CacheStore& store, SessionId id,
                                const std::vector<int32_t>& layers,
                                const std::string& page_token,
                                int64_t max_bytes,
                                v1::GetBlockTablesResponse* out) {
  absl::StatusOr<Cursor> cursor = CursorOf(page_token, layers.size());
  if (!cursor.ok()) return cursor.status();
  // Room for the next token (at most 64 bytes) and each table's tag.
  const int64_t budget =
      std::max<int64_t>(max_bytes, kMinBlockTablePageBytes) - 64;
  for (size_t i = cursor->index; i < layers.size(); ++i) {
    absl::StatusOr<BlockTable> table = store.GetBlockTable(id, layers[i]);
    if (!table.ok()) return table.status();
    const int64_t total = static_cast<int64_t>(table->positions.size());
    int64_t slot = 0;
    if (i == cursor->index && cursor->slot > 0) {
      if (table->version != cursor->version) {
        return absl::AbortedError(absl::StrCat(
            "layer ", layers[i], " changed between pages (version ",
            cursor->version, ", now ", table->version,
            "): ask again without a page_token"));
      }
      slot = std::min(cursor->slot, total);
    }
    const int64_t room = budget - static_cast<int64_t>(out->ByteSizeLong()) - 8;
    v1::BlockTable part;
    PartToProto(*table, slot, total - slot, &part);
    if (static_cast<int64_t>(part.ByteSizeLong()) <= room) {
      *out->add_tables() = std::move(part);
      continue;
    }
    // The rest of this table does not fit. After other tables, it starts
    // the next page; alone, it is cut after as many whole pages as fit (a
    // slot takes at most 20 bytes, a page id 5), one page at the least.
    if (out->tables_size() > 0) {
      out->set_next_page_token(TokenOf({i, slot, table->version}));
      return absl::OkStatus();
    }
    const int64_t pt = table->page_tokens;
    int64_t n =
        std::clamp<int64_t>(room / (20 * pt + 5) * pt, pt, total - slot);
    for (;;) {
      part.Clear();
      PartToProto(*table, slot, n, &part);
      if (static_cast<int64_t>(part.ByteSizeLong()) <= room || n <= pt) break;
      n = std::max<int64_t>(pt, n / 2 / pt * pt);
    }
    *out->add_tables() = std::move(part);
    if (slot + n < total) {
      out->set_next_page_token(TokenOf({i, slot + n, table->version}));
    } else if (i + 1 < layers.size()) {
      out->set_next_page_token(TokenOf({i + 1, 0, 0}));
    }
    return absl::OkStatus();
  }
  return absl::OkStatus();
}

}  // namespace kvkeep

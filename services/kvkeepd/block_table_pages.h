// GetBlockTables answers in pages that fit in a message. A session of 32
// layers holding 128k tokens each has block tables of about 50-100 MB,
// over any sensible message limit; the answer then goes in pages, each as
// full as the limit allows, a layer's table split at a page boundary when
// it alone does not fit (kvkeep.proto, GetBlockTablesRequest).
#ifndef KVKEEP_SERVICES_KVKEEPD_BLOCK_TABLE_PAGES_H_
#define KVKEEP_SERVICES_KVKEEPD_BLOCK_TABLE_PAGES_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "cache_store/cache_store.h"
#include "kvkeep/v1/kvkeep.pb.h"

namespace kvkeep {

// The smallest page a caller may ask for (max_page_bytes).
inline constexpr int64_t kMinBlockTablePageBytes = 4096;

// Fills `out` with the page of `layers`' tables (already checked to exist)
// that `page_token` starts (empty: the first), at most `max_bytes`
// serialized, and sets its next_page_token when more follows.
// INVALID_ARGUMENT for a token this call did not make; ABORTED when a
// split layer changed between pages.
absl::Status FillBlockTablePage(CacheStore& store, SessionId id,
                                const std::vector<int32_t>& layers,
                                const std::string& page_token,
                                int64_t max_bytes,
                                v1::GetBlockTablesResponse* out);

}  // namespace kvkeep

#endif  // KVKEEP_SERVICES_KVKEEPD_BLOCK_TABLE_PAGES_H_

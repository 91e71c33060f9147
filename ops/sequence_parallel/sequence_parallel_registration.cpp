// ulysses_attention: its schema, its composite and its shared rules.
#include <torch/library.h>

#include "ops/common/op_rules.h"
#include "ops/sequence_parallel/ulysses_attention.h"

TORCH_LIBRARY_FRAGMENT(offload, m) {
  // segment_attention over a sequence split across the ranks of the process group named group_name
  // (Ulysses): query [batch, heads, tokens / ranks, head_dim] and key, value [batch, kv_heads, tokens
  // / ranks, head_dim] are this rank's contiguous chunk of the rows, segment_ids [batch, tokens] the
  // whole rows'; returns this rank's chunk of the output. softcap, sinks [heads] and window are
  // segment_attention's. A composite of functional collectives and segment_attention
  // (ulysses_attention.cpp): no kernels of its own.
  m.def(
      "ulysses_attention(Tensor query, Tensor key, Tensor value, Tensor segment_ids, str group_name, "
      "float? scale=None, float? softcap=None, Tensor? sinks=None, int? window=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(offload, CompositeImplicitAutograd, m) {
  m.impl("ulysses_attention", &torch_offload::ulysses_attention_composite);
}

namespace torch_offload {
namespace {

// A composite: autocast passes it by and meets the segment_attention inside.
const SharedOpRules sequence_parallel_rules({"ulysses_attention"}, UnderAutocast::kInputDtypes);

}  // namespace
}  // namespace torch_offload

"""V1's query layout of a draft step: ``block_size`` queries per request, [anchor, mask x (block - 1)].

Upstream's DFlash layout kernel (``_copy_and_expand_dflash_inputs``) fills the proposer's buffers;
the rows sampled are all of them (anchor-first) or the masks (1 + N layout).
"""

from __future__ import annotations

import torch
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.spec_decode.utils import _copy_and_expand_dflash_inputs, next_power_of_2


def lay_out_queries(p, target_token_ids, next_token_ids, target_positions, target_hidden_states, cad,
                    num_rejected_tokens_gpu):
    """Lay out ``block_size`` queries per request: [anchor, mask x (block - 1)].

    Context states become K/V only (``_dflash_hidden_states``); the query rows
    sampled are all of them (anchor-first) or the masks (1 + N layout).
    """
    batch = cad.batch_size()
    num_context = target_token_ids.shape[0]
    per_req = p.block
    total = batch * per_req
    p._dflash_num_context = num_context
    p._dflash_hidden_states = target_hidden_states
    mask_rows = torch.empty(batch * (per_req - 1), dtype=torch.int32, device=p.device)
    max_tokens = cad.max_query_len + per_req
    has_rej = num_rejected_tokens_gpu is not None
    _copy_and_expand_dflash_inputs(
        next_token_ids_ptr=next_token_ids, target_positions_ptr=target_positions,
        out_input_ids_ptr=p.input_ids, out_context_positions_ptr=p._context_positions_buffer,
        out_query_positions_ptr=p.positions,
        out_context_slot_mapping_ptr=p._context_slot_mapping_buffer,
        out_query_slot_mapping_ptr=p._slot_mapping_buffer, out_token_indices_ptr=mask_rows,
        block_table_ptr=cad.block_table_tensor, query_start_loc_ptr=cad.query_start_loc,
        num_rejected_tokens_ptr=num_rejected_tokens_gpu if has_rej else 0,
        block_table_stride=cad.block_table_tensor.stride(0),
        parallel_drafting_token_id=p.parallel_drafting_token_id, block_size=p.block_size,
        num_query_per_req=per_req, num_speculative_tokens=per_req - 1, total_input_tokens=num_context,
        max_tokens_per_req=max_tokens, triton_block_size=min(256, next_power_of_2(max_tokens)),
        has_num_rejected=has_rej)
    rows = p.arange[:total].to(torch.int32) if p.anchor_first else mask_rows
    seq_lens = cad.seq_lens - num_rejected_tokens_gpu if has_rej else cad.seq_lens
    upper = cad.seq_lens_cpu_upper_bound
    new_cad = CommonAttentionMetadata(
        query_start_loc=p.arange[: batch + 1] * per_req,
        seq_lens=seq_lens + per_req,
        query_start_loc_cpu=torch.from_numpy(p.token_arange_np[: batch + 1]).clone() * per_req,
        seq_lens_cpu_upper_bound=None if upper is None else upper + per_req,
        num_reqs=cad.num_reqs, num_actual_tokens=total, max_query_len=per_req,
        max_seq_len=cad.max_seq_len + per_req, block_table_tensor=cad.block_table_tensor,
        slot_mapping=p._slot_mapping_buffer[:total], causal=p.dflash_causal)
    return total, rows, new_cad

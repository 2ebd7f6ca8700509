"""The pieces of qwen3_next_decode.py (the entry point, one folder up): model (transformers
glue), server (specstated's flags and layout), runner (specstate.kit's step I/O and pools),
verify_forward (the packed verify forward with the GDN kernels replaced), decode (drafts,
requests, prefill, spec_decode) and check (the reference, the comparison, the report)."""

"""Device-specific speed machinery, chosen once from device and dtype: on CPU, oneDNN-packed
decode weights and the allocator setting that keeps freed memory."""

"""What the Qwen2-VL lineage shares (Tarsier2, Qwen2-VL, Qwen2.5-VL): M-RoPE positions, frame patches, the
checkpoint's image processor and chat template, the frame-batched vision blocks, the device model's common half."""

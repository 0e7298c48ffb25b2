"""Tarsier v1 (Tarsier-7b, Tarsier-34b): LLaVA-style CLIP + Llama with frame separators.

`config` (what config.json says), `processing` (the CPU side: frames and prompts, what decoding workers import),
`modeling` (the network), `weights` (its checkpoint layout), `family` (the device model behind the family
interface). Importing this package imports none of them: a decoding worker needs the processing alone.
"""

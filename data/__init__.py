"""Data: tokenizers (GPT-2 BPE offline, character-level), corpus preparation, memmap batch loading."""

"""`mt serve`: OpenAI's completions API over mt's decoding at any layout (the HTTP side on
rank 0, continuous batching on every rank)."""

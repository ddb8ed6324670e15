"""The asynchronous batch lane: queued requests, the OpenAI Batch API, a durable store."""

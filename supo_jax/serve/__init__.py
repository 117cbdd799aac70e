"""`supo-jax serve`: the policy behind an OpenAI-compatible HTTP endpoint (docs/SERVING.md).

api: the wire format (request checks, response bodies); engine: requests as sampler rows,
continuously batched; app: the Starlette routes and the uvicorn server; harness and sessions:
harness mode, an OpenAI-API agent's rollouts run by the driver (docs/HARNESS.md)."""

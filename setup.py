from setuptools import find_packages, setup

setup(
    name="supo-jax",
    version="0.1.0",
    description="JAX/TPU-native SUPO: RL for LLM agents with end-to-end learned summarization",
    long_description=open("README.md").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["supo_jax", "supo_jax.*"]),
    python_requires=">=3.10",
    install_requires=[
        "jax>=0.6",
        "flax>=0.11",
        "optax>=0.2.4",
        "orbax-checkpoint>=0.11",
        "chex>=0.1.88",
        "numpy>=1.26",
        "ml_dtypes>=0.5",
        "transformers>=4.51",
        "tokenizers>=0.21",
        "jinja2>=3.1",
        "gguf>=0.16",
        "tensorflow-datasets>=4.9.8",
        "array_record>=0.7",
        "bm25s>=0.2",
        "tqdm>=4.66",
        "tensorboardX>=2.6",
        "matplotlib>=3.8",
        # run directories in a bucket (gs://): gcsfs for files, google-cloud-storage (its
        # dependency) for TensorBoard's writer; Orbax writes arrays through tensorstore
        "gcsfs>=2024.2",
        # supo-jax serve: the OpenAI-compatible HTTP endpoint (supo_jax/serve)
        "starlette>=0.40",
        "uvicorn>=0.30",
    ],
    extras_require={
        "test": ["pytest>=8", "pytest-xdist>=3.5", "torch==2.13.0", "accelerate>=1.0",
                 "safetensors>=0.4", "nbclient>=0.10", "nbformat>=5.10", "ipykernel>=6.29",
                 # LoRA adapters checked against peft's (tests/test_lora.py)
                 "peft>=0.17",
                 # a GCS API server on a loopback port (tests/gcs.py)
                 "gcp-storage-emulator>=2024.8",
                 # the serving endpoint driven by the official client (tests/test_serve.py)
                 "openai>=1.0", "httpx>=0.27",
                 # benchmarks/serve.py's clients (as vLLM's serving benchmark's)
                 "aiohttp>=3.9",
                 # makes the external harnesses' venvs (supo_jax/harnesses/verifiers_venv.py)
                 "uv>=0.5",
                 # what bfcl-eval's own `bfcl` command imports beyond ours (bfcl-eval itself
                 # goes in --no-deps: its pins clash; tests/test_bfcl_runner.py)
                 "overrides>=7.4", "tenacity>=8.2", "python-dotenv>=1.0", "tabulate>=0.9",
                 # compiles for TPU slices ahead of time on CPU (tests/test_tpu_compile.py)
                 "libtpu==0.0.42.1; sys_platform == 'linux'"],
        "tpu": ["jax[tpu]>=0.6"],
    },
    entry_points={"console_scripts": ["supo-jax=supo_jax.cli:main"]},
)

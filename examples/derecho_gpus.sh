# docs/howto/deploy.md, "GPU architecture on login nodes": the line a site puts in its install scripts, for the
# clients that do not read a profile (conda, pixi): the GPUs of Derecho's compute nodes as site-env-derecho
# declares them. Source it before the install: . examples/derecho_gpus.sh
export CONDA_OVERRIDE_CUDA=12.4 CONDA_OVERRIDE_CUDA_ARCH=8.0   # Derecho's compute nodes: 4x A100

# GPU image: NGC PyTorch (CUDA, NCCL, Transformer Engine preinstalled) + dynmo_plugin.
# Not built in CI (no Docker engine there); see docs/docker.md.
ARG BASE=nvcr.io/nvidia/pytorch:25.01-py3
FROM ${BASE}

WORKDIR /opt/dynmo_plugin
COPY setup.cfg pyproject.toml README.md constraints.txt ./
COPY dynmo_plugin ./dynmo_plugin
COPY configs ./configs
COPY scripts ./scripts

# Keep NGC's own torch and Transformer Engine: pin them to what the image ships, so pip
# never replaces them with registry wheels.
RUN pip freeze | grep -iE '^(torch|transformer[-_]engine[^=]*)==' > /tmp/ngc-pins.txt \
 && pip install --no-cache-dir -c /tmp/ngc-pins.txt "megatron-core==0.16.1" ".[gpu]"

ENV OMP_NUM_THREADS=1
ENTRYPOINT ["torchrun"]
CMD ["--nproc-per-node", "8", "-m", "dynmo_plugin.train", "--dynmo", "--dynmo-config", "configs/demo.yaml", "--pipeline-model-parallel-size", "4"]

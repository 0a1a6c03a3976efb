#!/usr/bin/env bash
# Install the flavor's activation scripts into PREFIX: the POSIX scripts for bash/zsh/dash, and
# csh/tcsh and fish wrappers that run them with sh and apply the changes they print (CONDA_PREFIX
# is the environment while conda sources activate.d and deactivate.d).
set -euo pipefail

for change in activate deactivate; do
    dir="${PREFIX:?the engine sets PREFIX}/etc/conda/${change}.d"
    mkdir -p "$dir"
    cp "${RECIPE_DIR:?the engine sets RECIPE_DIR}/${change}.sh" "${dir}/pytorch-nccl-fault.sh"
    script="\$CONDA_PREFIX/etc/conda/${change}.d/pytorch-nccl-fault.sh"
    printf '# pytorch-nccl-fault for csh/tcsh: pytorch-nccl-fault.sh beside this file makes the changes.\n%s\n' \
        "eval \"\`env _PYTORCH_NCCLFT_EMIT=csh sh ${script}\`\"" >"${dir}/pytorch-nccl-fault.csh"
    printf '# pytorch-nccl-fault for fish: pytorch-nccl-fault.sh beside this file makes the changes.\n%s\n' \
        "env _PYTORCH_NCCLFT_EMIT=fish sh \"${script}\" | source" >"${dir}/pytorch-nccl-fault.fish"
done

# shellcheck shell=sh
# pytorch-nccl-fault: unset the defaults activate.d/pytorch-nccl-fault.sh set (and only those: a
# variable the user had set was never touched), restoring the environment as it was.
for _pytorch_ncclft_var in ${_PYTORCH_NCCLFT_SET:-}; do
    unset "$_pytorch_ncclft_var"
done
unset _PYTORCH_NCCLFT_SET _pytorch_ncclft_var

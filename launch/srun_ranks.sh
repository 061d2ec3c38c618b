# Shared by the sbatch scripts: run "$@" on every rank with `srun`, each rank logging to its own file, or with
# --dry-run print what each rank would run. Needs TASKS_PER_NODE and GPUS_PER_TASK (a list like "0,1,2,3" or
# "one" for one GPU per task), and the SLURM job variables.

run_ranks() {
    local dry_run="$1"; shift
    local log_dir="${CLIP_JAX_LOG_DIR:-logs/slurm-${SLURM_JOB_NAME:-clip}-${SLURM_JOB_ID:-0}}"
    local nodes="${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:?not inside a SLURM allocation: submit with sbatch}}"
    local ntasks=$((nodes * TASKS_PER_NODE))
    if [[ "$GPUS_PER_TASK" != one ]]; then
        export CLIP_JAX_LOCAL_DEVICE_IDS="$GPUS_PER_TASK"
    fi
    if [[ "$dry_run" == 1 ]]; then
        local rank
        for ((rank = 0; rank < ntasks; rank++)); do
            echo "rank $rank (node $((rank / TASKS_PER_NODE)), local $((rank % TASKS_PER_NODE))):" \
                "log $log_dir/rank-$rank.log" \
                "env SLURM_PROCID=$rank SLURM_LOCALID=$((rank % TASKS_PER_NODE)) SLURM_NTASKS=$ntasks" \
                "CLIP_JAX_LOCAL_DEVICE_IDS=${CLIP_JAX_LOCAL_DEVICE_IDS:-} CLIP_JAX_HEARTBEAT_TIMEOUT=$CLIP_JAX_HEARTBEAT_TIMEOUT" \
                "CLIP_JAX_INIT_TIMEOUT=$CLIP_JAX_INIT_TIMEOUT JAX_COMPILATION_CACHE_DIR=$JAX_COMPILATION_CACHE_DIR" \
                "NCCL_DEBUG=$NCCL_DEBUG XLA_PYTHON_CLIENT_MEM_FRACTION=$XLA_PYTHON_CLIENT_MEM_FRACTION" \
                "XLA_FLAGS='$XLA_FLAGS'" \
                "cmd: $*"
        done
        return 0
    fi
    mkdir -p "$log_dir" "$JAX_COMPILATION_CACHE_DIR"
    echo "$ntasks ranks on $nodes nodes; logs in $log_dir/rank-N.log"
    srun --ntasks="$ntasks" --ntasks-per-node="$TASKS_PER_NODE" --kill-on-bad-exit=1 \
        --output="$log_dir/rank-%t.log" "$@"
}

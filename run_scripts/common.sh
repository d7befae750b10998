# Shared by the run_*.sh recipes: named flags -> one `rapidformer` launcher command, printed, then run (or, with
# --dry-run, the plan of the run: python -m megatron_patch.training.plan).
#
#   export CUDA_VISIBLE_DEVICES=0,1,2,3,4,5,6,7 MASTER_ADDR=10.0.0.1 MASTER_PORT=6010 NNODES=2 NODE_RANK=0
#   examples/gpt/run_pretrain_gpt.sh --model-size llama2-7b --tp 4 --pp 2 --data-path /data/corpus_text_document \
#       --tokenizer-type Llama2Tokenizer --tokenizer-model /data/tokenizer.model --output-dir /ckpt/llama2-7b
#
# A recipe sets RECIPE, RECIPE_SUMMARY, DEFAULT_MODEL, CPU_MODEL, DEFAULT_LR, DEFAULT_MIN_LR, DEFAULT_TRAIN_ITERS
# and DEFAULT_TOKENIZER (a fine-tuning recipe LOAD_FINETUNES=1), sources this file, calls `parse_flags "$@"` and
# ends in `launch <its own rapidformer flags>`. Environment, as in the seed's scripts:
# CUDA_VISIBLE_DEVICES MASTER_ADDR MASTER_PORT NNODES NODE_RANK (defaults: every visible GPU, one node, 127.0.0.1,
# a free port); PYTHON names the interpreter.

set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# Runs from a checkout without `pip install` too.
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1  # log lines reach the log file as they happen, through tee
if [[ -z ${PYTHON:-} ]]; then
  PYTHON=$(command -v python || command -v python3 || true)
fi

die() {
  echo "$(basename "$0"): error: $*" >&2
  exit 2
}

note() {
  echo "$(basename "$0"): $*" >&2
}

usage() {
  cat <<EOF
usage: $(basename "$0") [flags] [-- rapidformer flags]

$RECIPE_SUMMARY

model and precision
  --model-size NAME          a registered model (megatron-patch: megatron_patch/model/config.py), e.g. gpt2-124m,
                             llama2-7b, llama3-8b, qwen2-7b, qwen3-0.6b, bert-base, tiny-gpt2, tiny-bert; mixtures
                             of experts mixtral-8x7b, qwen2-moe-a2.7b, qwen3-moe-30b-a3b, tiny-mixtral,
                             tiny-qwen2-moe (default $DEFAULT_MODEL, $CPU_MODEL with --cpu); omitted when the
                             checkpoint to load describes its model
  --precision fp16|bf16|fp32 (default bf16, fp32 with --cpu)
  --seq-length N             sequence length (default: the model's)
parallelism and memory
  --tp N                     tensor-parallel size (--tensor-model-parallel-size; default 1)
  --pp N                     pipeline-parallel size (--pipeline-model-parallel-size; default 1)
  --vpp N                    model chunks per pipeline rank, interleaved 1F1B (--virtual-pipeline-model-parallel-size)
  --cp N                     context-parallel size (needs Transformer Engine; default 1)
  --sp                       sequence parallelism (needs --tp > 1; a mixture of experts with --tp > 1 needs it)
  --ep N                     expert-parallel size: each rank holds experts / N of every MoE layer
                             (--expert-model-parallel-size; default 1)
  --etp N                    tensor parallelism inside each expert (--expert-tensor-parallel-size; default --tp)
  --distributed-optimizer    shard optimizer state over data-parallel ranks (--use-distributed-optimizer)
  --recompute selective|full|none   activation checkpointing (default none)
batches and schedule
  --micro-batch-size N       sequences per GPU per microbatch (default 1)
  --global-batch-size N      sequences per step; gradient accumulation = global / (micro x data-parallel size)
  --train-iters N            optimizer steps (default: ${DEFAULT_TRAIN_ITERS:-as many as --epochs take})
  --train-tokens N           or tokens: ceil(N / (global batch x seq length)) steps
  --lr LR  --min-lr LR  --lr-warmup-iters N   (defaults $DEFAULT_LR, $DEFAULT_MIN_LR, 0)
data, tokenizer, checkpoints, output
  --data-path PATH           data (repeat, or quote a blend: "0.3 prefixA 0.7 prefixB"; no spaces in paths)
  --data-name NAME  --epochs N   fine-tuning: the task under --data-path (e.g. mrpc) and the passes over it
  --tokenizer-type TYPE  --vocab-file F  --merge-file F  --tokenizer-model F
                             (the type defaults to $DEFAULT_TOKENIZER when files are given)
  --load DIR                 checkpoint to start from (default: resume OUTPUT/checkpoints when it has one)
  --save-interval N          save every N steps (a checkpoint is always written at the end)
  --output-dir DIR           OUTPUT: logs/, tensorboard/, checkpoints/ go under it
                             (default ./output/$RECIPE-MODEL)
launch
  --nproc-per-node N         processes per node (default: one per GPU in CUDA_VISIBLE_DEVICES, 1 on CPU)
  --cpu                      CPU processes with gloo (hides the GPUs); tiny model and fp32 by default
  --dry-run                  print the plan (world size, layout, batches, memory per GPU) and the command; run
                             nothing
  -h, --help                 this help
  --                         everything after it goes to rapidformer unchanged (rapidformer --help lists them),
                             e.g. a mixture of experts' model flags: -- --num-experts 16 --moe-router-topk 2

environment: CUDA_VISIBLE_DEVICES MASTER_ADDR MASTER_PORT NNODES NODE_RANK (one node on this host by default;
for NNODES > 1 set MASTER_ADDR and MASTER_PORT to node 0's address and a free port, NODE_RANK per node), PYTHON
EOF
}

_positive() {  # flag value [minimum]
  [[ $2 =~ ^[0-9]+$ ]] && ((10#$2 >= ${3:-1})) || die "$1 must be an integer >= ${3:-1}, got '$2'"
}

_one_of() {  # flag value choices...
  local flag=$1 value=$2 choice
  shift 2
  for choice in "$@"; do [[ $value == "$choice" ]] && return 0; done
  die "$flag must be one of $*, got '$value'"
}

parse_flags() {
  MODEL_SIZE="" PRECISION="" SEQ_LENGTH="" TP=1 PP=1 VPP="" CP=1 EP=1 ETP="" SP=0 DISTRIBUTED_OPTIMIZER=0 RECOMPUTE=none
  MICRO_BATCH_SIZE=1 GLOBAL_BATCH_SIZE="" TRAIN_ITERS="" TRAIN_TOKENS="" LR=$DEFAULT_LR MIN_LR=$DEFAULT_MIN_LR
  LR_WARMUP_ITERS=0 DATA_PATH=() TOKENIZER_TYPE="" VOCAB_FILE="" MERGE_FILE="" TOKENIZER_MODEL="" LOAD=""
  SAVE_INTERVAL="" OUTPUT_DIR="" NPROC_PER_NODE="" CPU=0 DRY_RUN=0 EXTRA=() DATA_NAME="" EPOCHS=""
  local flag var words
  while (($#)); do
    flag=$1
    if [[ $flag == --*=* ]]; then  # --flag=value
      set -- "${flag%%=*}" "${flag#*=}" "${@:2}"
      flag=$1
    fi
    case $flag in
      -h | --help) usage; exit 0 ;;
      --cpu) CPU=1; shift; continue ;;
      --sp) SP=1; shift; continue ;;
      --distributed-optimizer) DISTRIBUTED_OPTIMIZER=1; shift; continue ;;
      --dry-run) DRY_RUN=1; shift; continue ;;
      --) shift; EXTRA=("$@"); break ;;
      --model-size) var=MODEL_SIZE ;;
      --precision) var=PRECISION ;;
      --seq-length) var=SEQ_LENGTH ;;
      --tp) var=TP ;;
      --pp) var=PP ;;
      --vpp) var=VPP ;;
      --cp) var=CP ;;
      --ep) var=EP ;;
      --etp) var=ETP ;;
      --recompute) var=RECOMPUTE ;;
      --micro-batch-size) var=MICRO_BATCH_SIZE ;;
      --global-batch-size) var=GLOBAL_BATCH_SIZE ;;
      --train-iters) var=TRAIN_ITERS ;;
      --train-tokens) var=TRAIN_TOKENS ;;
      --lr) var=LR ;;
      --min-lr) var=MIN_LR ;;
      --lr-warmup-iters) var=LR_WARMUP_ITERS ;;
      --data-path) var=DATA_PATH ;;
      --data-name) var=DATA_NAME ;;
      --epochs) var=EPOCHS ;;
      --tokenizer-type) var=TOKENIZER_TYPE ;;
      --vocab-file) var=VOCAB_FILE ;;
      --merge-file) var=MERGE_FILE ;;
      --tokenizer-model) var=TOKENIZER_MODEL ;;
      --load) var=LOAD ;;
      --save-interval) var=SAVE_INTERVAL ;;
      --output-dir) var=OUTPUT_DIR ;;
      --nproc-per-node) var=NPROC_PER_NODE ;;
      *) die "unknown flag '$flag' (see --help; rapidformer's own flags go after --)" ;;
    esac
    (($# >= 2)) && [[ $2 != --* ]] || die "$flag needs a value"
    if [[ $var == DATA_PATH ]]; then
      read -ra words <<<"$2"
      DATA_PATH+=("${words[@]}")
    else
      printf -v "$var" '%s' "$2"
    fi
    shift 2
  done

  # The form of the recipe's own flags only: whether the sizes fit the processes, the model and the batch is
  # megatron_patch/layout.py's to say, which the launcher asks before torchrun starts (and the plan for --dry-run).
  for var in TP PP CP EP MICRO_BATCH_SIZE; do _positive "--$(_flag_of $var)" "${!var}"; done
  for var in VPP ETP GLOBAL_BATCH_SIZE SEQ_LENGTH TRAIN_ITERS TRAIN_TOKENS SAVE_INTERVAL NPROC_PER_NODE EPOCHS; do
    [[ -z ${!var} ]] || _positive "--$(_flag_of $var)" "${!var}"
  done
  _positive --lr-warmup-iters "$LR_WARMUP_ITERS" 0
  [[ -z $PRECISION ]] || _one_of --precision "$PRECISION" fp16 bf16 fp32
  _one_of --recompute "$RECOMPUTE" selective full none
  [[ -z $TRAIN_ITERS || -z $TRAIN_TOKENS ]] || die "give --train-iters or --train-tokens, not both"
  [[ -n $TRAIN_ITERS || -n $TRAIN_TOKENS || -n $EPOCHS ]] || TRAIN_ITERS=$DEFAULT_TRAIN_ITERS
  if ((CPU)); then
    export CUDA_VISIBLE_DEVICES=""  # torch then sees no GPU: gloo and CPU tensors
    PRECISION=${PRECISION:-fp32}
  fi
  PRECISION=${PRECISION:-bf16}
  MODEL=${MODEL_SIZE:-$DEFAULT_MODEL}
  ((!CPU)) || MODEL=${MODEL_SIZE:-$CPU_MODEL}
  OUTPUT_DIR=${OUTPUT_DIR:-output/$RECIPE-$MODEL}
  [[ $OUTPUT_DIR == /* ]] || OUTPUT_DIR=$PWD/$OUTPUT_DIR
  [[ -n $PYTHON ]] || die "no python found; set PYTHON=/path/to/python"
}

_flag_of() {  # MICRO_BATCH_SIZE -> micro-batch-size
  echo "$1" | tr 'A-Z_' 'a-z-'
}

_check_environment() {
  local nnodes=${NNODES:-1} node_rank=${NODE_RANK:-0}
  [[ $nnodes =~ ^[1-9][0-9]*$ ]] || die "NNODES must be a positive integer, got '$nnodes'"
  [[ $node_rank =~ ^[0-9]+$ ]] && ((node_rank < nnodes)) ||
    die "NODE_RANK must be an integer from 0 to NNODES-1 ($((nnodes - 1))), got '$node_rank'"
  if ((nnodes > 1 && !DRY_RUN)) && [[ -z ${MASTER_ADDR:-} || -z ${MASTER_PORT:-} ]]; then
    die "NNODES=$nnodes needs MASTER_ADDR (node 0's address) and MASTER_PORT (the same free port) on every node"
  fi
}

# The rapidformer flags of the named flags (FLAGS), after the recipe's own.
_rapidformer_flags() {
  local load=$LOAD checkpoints=$OUTPUT_DIR/checkpoints description finetune=()
  # The package names a checkpoint directory's files (its tracker, its model's description); the recipes ask it.
  # A fine-tuning recipe's --load (LOAD_FINETUNES=1) starts the first run only, with --finetune; once
  # OUTPUT/checkpoints holds a checkpoint, a rerun resumes from there as any recipe does.
  if [[ -z $load || ${LOAD_FINETUNES:-0} == 1 ]] \
      && "$PYTHON" -m megatron_patch.checkpoint tracker "$checkpoints" >/dev/null; then
    load=$checkpoints
    note "resuming from $checkpoints (it holds a checkpoint; another --output-dir starts anew)"
  elif [[ -n $load && ${LOAD_FINETUNES:-0} == 1 ]]; then
    finetune=(--finetune)
  fi
  FLAGS=()
  if [[ -n $load ]] && description=$("$PYTHON" -m megatron_patch.checkpoint description "$load"); then
    [[ -z $MODEL_SIZE ]] || note "the model comes from $description; --model-size is not passed"
  else
    FLAGS+=(--model-name "$MODEL")
  fi
  [[ -z $NPROC_PER_NODE ]] || FLAGS+=(--nproc-per-node "$NPROC_PER_NODE")
  case $PRECISION in bf16) FLAGS+=(--bf16) ;; fp16) FLAGS+=(--fp16) ;; esac
  [[ -z $SEQ_LENGTH ]] || FLAGS+=(--seq-length "$SEQ_LENGTH")
  FLAGS+=(--tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP")
  [[ -z $VPP ]] || FLAGS+=(--virtual-pipeline-model-parallel-size "$VPP")
  ((CP == 1)) || FLAGS+=(--context-parallel-size "$CP")
  ((EP == 1)) || FLAGS+=(--expert-model-parallel-size "$EP")
  [[ -z $ETP ]] || FLAGS+=(--expert-tensor-parallel-size "$ETP")
  ((!SP)) || FLAGS+=(--sequence-parallel)
  ((!DISTRIBUTED_OPTIMIZER)) || FLAGS+=(--use-distributed-optimizer)
  [[ $RECOMPUTE == none ]] || FLAGS+=(--recompute-granularity "$RECOMPUTE")
  FLAGS+=(--micro-batch-size "$MICRO_BATCH_SIZE")
  [[ -z $GLOBAL_BATCH_SIZE ]] || FLAGS+=(--global-batch-size "$GLOBAL_BATCH_SIZE")
  FLAGS+=(--lr "$LR" --min-lr "$MIN_LR" --lr-warmup-iters "$LR_WARMUP_ITERS")
  ((${#DATA_PATH[@]} == 0)) || FLAGS+=(--data-path "${DATA_PATH[@]}")
  [[ -z $DATA_NAME ]] || FLAGS+=(--data-name "$DATA_NAME")
  [[ -z $EPOCHS ]] || FLAGS+=(--epochs "$EPOCHS")
  # The recipe's tokenizer type goes with its files; without any, the model's own vocabulary is planned with.
  if [[ -n $TOKENIZER_TYPE$VOCAB_FILE$MERGE_FILE$TOKENIZER_MODEL ]]; then
    FLAGS+=(--tokenizer-type "${TOKENIZER_TYPE:-$DEFAULT_TOKENIZER}")
  fi
  [[ -z $VOCAB_FILE ]] || FLAGS+=(--vocab-file "$VOCAB_FILE")
  [[ -z $MERGE_FILE ]] || FLAGS+=(--merge-file "$MERGE_FILE")
  [[ -z $TOKENIZER_MODEL ]] || FLAGS+=(--tokenizer-model "$TOKENIZER_MODEL")
  [[ -z $load ]] || FLAGS+=(--load "$load" "${finetune[@]}")
  # A preempted job (SIGTERM) saves at the end of its iteration; rerunning the recipe resumes from that save.
  FLAGS+=(--save "$checkpoints" --exit-signal-handler)
  [[ -z $SAVE_INTERVAL ]] || FLAGS+=(--save-interval "$SAVE_INTERVAL")
  FLAGS+=(--log-dir "$OUTPUT_DIR/logs")
  FLAGS+=(--tensorboard-dir "$OUTPUT_DIR/tensorboard")
}

_quote() {  # a word as the shell reads it back; plain words stay plain (printf %q would write 98\,2)
  if [[ $1 =~ ^[A-Za-z0-9_./:,@%+=-]+$ ]]; then printf '%s' "$1"; else printf '%q' "$1"; fi
}

# The command line as one copy-pasteable line: the launch environment, then the command.
_print_command() {
  local var word line="+"
  for var in CUDA_VISIBLE_DEVICES MASTER_ADDR MASTER_PORT NNODES NODE_RANK; do
    [[ -z ${!var+set} ]] || line+=" $var=$(_quote "${!var}")"
  done
  for word in "$@"; do line+=" $(_quote "$word")"; done
  echo "$line"
}

# launch RECIPE_FLAGS...: the recipe's rapidformer flags (--user-script FILE ...), then the named flags', then
# what came after --; later flags win in rapidformer's parser, so `-- --lr-decay-style linear` overrides a recipe.
launch() {
  _check_environment
  _rapidformer_flags
  if [[ -n $TRAIN_TOKENS ]]; then
    TRAIN_ITERS=$("$PYTHON" -m megatron_patch.training.plan --print-train-iters --train-tokens "$TRAIN_TOKENS" \
      "$@" "${FLAGS[@]}" "${EXTRA[@]}")
    note "--train-tokens $TRAIN_TOKENS: $TRAIN_ITERS iterations"
  fi
  local flags=("$@" "${FLAGS[@]}" ${TRAIN_ITERS:+--train-iters "$TRAIN_ITERS"} "${EXTRA[@]}")
  local command=("$PYTHON" -m megatron_patch.training.launcher "${flags[@]}")
  if ((DRY_RUN)); then
    "$PYTHON" -m megatron_patch.training.plan "${flags[@]}"
    echo "the command it would run:"
    _print_command "${command[@]}"
    return 0
  fi
  mkdir -p "$OUTPUT_DIR/logs" "$OUTPUT_DIR/checkpoints"
  # Under srun the launcher takes the node's rank from SLURM_PROCID (megatron_patch/training/nodes.py, slurm_launch).
  local log=$OUTPUT_DIR/logs/${RECIPE}_node${NODE_RANK:-${SLURM_PROCID:-0}}.log
  _print_command "${command[@]}" | tee -a "$log"
  # Preemption (SIGTERM to this process group) is the launcher's to handle: it passes the signal to the ranks, which
  # save, and exits 0 once they have. The shell and tee ignore it so that they wait for that, and the ranks' last
  # lines still reach the log (the launcher sets its own handler, so it does not inherit the ignoring). A Ctrl-C
  # reaches the terminal's whole process group: tee ignores it too, or it died at once and the launcher's lines
  # after it (what was saved, what to resume from) went nowhere.
  trap '' TERM
  "${command[@]}" 2>&1 | (trap '' INT; exec tee -a "$log")
}

#!/usr/bin/env bash
# Drive `ktlong chat`'s real terminal UI under tmux (send-keys, capture-pane) and print what the
# screen showed at each step: progress bar, prompt, streamed answers, stats lines, multiline input
# (Esc Enter and a trailing backslash), slash commands, Ctrl-C during an answer, Ctrl-C twice to
# leave.
#
#   docs/tmux-chat.sh [MODEL]     # default: a tiny random model built in a temp folder
#
# Needs tmux (apt-get install tmux). Exits non-zero if a step's screen never appeared.
set -euo pipefail
command -v tmux >/dev/null || { echo "tmux is not installed (apt-get install tmux)" >&2; exit 1; }
PY=${PYTHON:-python}
WORK=$(mktemp -d)
SESSION=ktlong-chat
TMUX_CMD=(tmux -L "ktlong-chat-$$")  # a private server: never touches the user's own tmux
export KTLONG_HOME=$WORK/home
trap '"${TMUX_CMD[@]}" kill-server 2>/dev/null || true; rm -rf "$WORK"' EXIT

MODEL=${1:-$WORK/model}
"$PY" - "$MODEL" "$WORK/book.txt" <<'EOF'
import os, sys
from ktlong.tinymodel import filler_text, make_model
model, doc = sys.argv[1:]
if not os.path.exists(model):
    import transformers
    transformers.utils.logging.disable_progress_bar()
    make_model(model, "llama", seed=1)
open(doc, "w").write(filler_text(6000, seed=7))
EOF

CMD="$PY -m ktlong chat --model $MODEL --prompt-file $WORK/book.txt --profile dense"
CMD="$CMD --max-seq-len 16384 --max-new-tokens 200 --temperature 0.8 --seed 1"
"${TMUX_CMD[@]}" new-session -d -s "$SESSION" -x 120 -y 45 "$CMD; echo \"[ktlong exited with \$?]\"; sleep 300"

screen() { "${TMUX_CMD[@]}" capture-pane -p -t "$SESSION" -S -200 | sed -e :a -e '/^\n*$/{$d;N;ba' -e '}'; }
count() { screen | grep -c -- "$1" || true; }
wait_for() {  # wait_for PATTERN [N] [SECONDS]: until PATTERN appears N times on screen
    local n=${2:-1} t=${3:-180}
    for _ in $(seq $((t * 4))); do
        [ "$(count "$1")" -ge "$n" ] && return 0
        sleep 0.25
    done
    echo "!! timed out waiting for '$1' x$n"; screen; exit 1
}
show() { echo; echo "======== $1"; screen | tail -n "${2:-45}"; }
keys() { "${TMUX_CMD[@]}" send-keys -t "$SESSION" "$@"; }

wait_for '>>>' 1 300
show "after start: progress bar, document line, banner, prompt" 20

keys '/help' Enter
wait_for 'leave (or Ctrl-D)' 1
keys 'What is the hidden key?' Enter
wait_for 'tok/s · prompt' 1
show "first answer streamed, then the dim stats line" 12

keys 'Two lines,' Escape Enter 'then a third \' Enter 'line.' Enter
wait_for 'tok/s · prompt' 2
show "multiline question (Esc Enter, trailing backslash) and its answer" 14

keys '/stats' Enter
wait_for '^last ' 1
keys '/frobnicate' Enter
wait_for 'unknown command' 1
show "/stats and an unknown command" 10

keys 'Tell me everything.' Enter
sleep 1.5
keys C-c
wait_for 'stopped by Ctrl-C' 1
keys '/reset' Enter
wait_for 'back to the document alone' 1
show "Ctrl-C during an answer keeps the chat; /reset" 10

keys 'half-typed line'
sleep 0.5
keys C-c
sleep 2.5
show "Ctrl-C with text at the prompt clears the line (the chat stays)" 3
keys C-c
wait_for 'press Ctrl-C again' 1 30
show "one Ctrl-C at an empty prompt only says how to leave" 3
keys C-c
wait_for 'ktlong exited with' 1 30
show "a second Ctrl-C leaves" 4
screen | grep -q 'ktlong exited with 130' || { echo "!! expected exit status 130"; exit 1; }
echo; echo "tmux-chat: every step appeared; exit status 130 after Ctrl-C twice at the prompt"

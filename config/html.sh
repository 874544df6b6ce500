# TASK_TYPE=html on procedural pages: a page costs ~3x a code turn, so fewer train and test tasks; the warm-up
# needs more oracle dialogues to write the stated facts into its page (docs/frontend.md).
: "${N_TRAIN:=30}" "${N_TEST:=150}" "${N_VAL:=25}" "${N_WARMUP:=240}" "${CANDIDATES:=6}" "${DATA_FRACTION:=0.25}"
: "${MAX_NEW_TOKENS:=192}"  # a procedural page is 122-161 tokens

# SMALL=1: the whole loop in a few minutes (sizes only; the recipe is the default's).
: "${N_TRAIN:=12}" "${N_TEST:=12}" "${N_VAL:=8}" "${N_WARMUP:=60}" "${SAMPLES:=2}" "${CANDIDATES:=4}"

# SMALL=1: the whole loop at small sizes (the recipe is the default's): a check that it runs, not a result.
: "${N_TRAIN:=12}" "${N_TEST:=12}" "${N_VAL:=8}" "${N_WARMUP:=60}" "${SAMPLES:=2}" "${CANDIDATES:=4}"

# TRAIN_TASKS / TEST_TASKS (ColBench files): the released recipe (the paper, Sec. 5; the release's commands).
# Every train task, the first 1,000 test tasks; no warm-up and no validation selection (N_VAL=50 turns it on,
# holding out the first 50 train tasks).
: "${N_TEST:=1000}" "${N_VAL:=0}" "${N_WARMUP:=0}" "${SAMPLES:=3}" "${CANDIDATES:=16}" "${DATA_FRACTION:=0.1}"
: "${MAX_NEW_TOKENS:=1024}" "${LR_CRITIC:=2e-7}" "${LR_DPO:=2e-7}" "${NLL_DPO:=0.01}"  # the paper's NLL weight
: "${LR_MTDPO:=2e-7}" "${LR_RFT:=2e-7}" "${NLL_MTDPO:=0.01}"  # the baselines at the released DPO rate

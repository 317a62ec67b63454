# The two commands a newcomer needs:
#   make demo   set up, build, and compare memplan with the baselines on GPT-2 small
#   make test   set up and run every test
.PHONY: demo test setup build

setup:
	@bash scripts/setup.sh

build: setup
	cargo build --release --bin memplan

demo: build
	./target/release/memplan compare --example gpt2-small

test: setup
	bash scripts/test.sh

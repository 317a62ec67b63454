# Shorthands for the README's two commands (scripts/demo.sh, scripts/test.sh).
.PHONY: demo test

demo:
	bash scripts/demo.sh

test:
	bash scripts/test.sh

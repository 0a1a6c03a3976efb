bash scripts/setup-venv.sh && . .venv/bin/activate && channelsmith build site-env && channelsmith deploy site-env-derecho --prefix ./env

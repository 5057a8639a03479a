from rlx.cli.main import run

run()

from maskkv_cli.cli import main

main()

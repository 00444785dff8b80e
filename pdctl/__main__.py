from pdctl.console.cli import main

main()

from fleetscope.cli import main

main()

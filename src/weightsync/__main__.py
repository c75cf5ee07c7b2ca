from weightsync.cli import main

main()

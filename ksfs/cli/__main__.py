from ksfs.cli import main

main()

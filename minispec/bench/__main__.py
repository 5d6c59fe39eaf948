from minispec.bench import main

main()

from stapo.quickstart.run import main

main()

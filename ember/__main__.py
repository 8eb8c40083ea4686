from ember.cli.main import main

main()

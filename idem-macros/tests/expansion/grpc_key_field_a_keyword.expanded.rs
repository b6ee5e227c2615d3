#[tonic::async_trait]
impl<DB: Sql> Payments for PaymentsApi<DB> {
    async fn create_payment(
        &self,
        __idem_grpc: Request<CreatePaymentRequest>,
    ) -> Result<Response<Payment>, Status> {
        #[allow(unused_imports)]
        use idempotent as _;
        static __IDEM_POLICY: ::idem_runtime::__private::HandlerPolicy = ::idem_runtime::__private::HandlerPolicy::__new(
                "create_payment",
                ::core::module_path!(),
                ::idem_runtime::__private::KeyScope::Parameter("tenant"),
                ::idem_runtime::__private::Mode::Transactional,
                86400u64,
                false,
                30u64,
                ::core::option::Option::None,
                ::core::option::Option::None,
                ::idem_runtime::__private::BodyFields::All,
            )
            .__grpc(
                <PaymentsServer<
                    (),
                > as ::idem_runtime::__private::grpc::tonic::server::NamedService>::NAME,
                "CreatePayment",
            )
            .__key(::idem_runtime::KeySource::MessageField("type"), false);
        ::idem_runtime::__private::inventory::submit! {
            ::idem_runtime::__private::Registered(& __IDEM_POLICY)
        }
        let tenant: Tenant = match <Tenant as ::idem_runtime::grpc::FromMetadata>::from_metadata(
            __idem_grpc.metadata(),
            __idem_grpc.extensions(),
        ) {
            ::core::result::Result::Ok(__idem_value) => __idem_value,
            ::core::result::Result::Err(__idem_status) => {
                return ::core::result::Result::Err(__idem_status);
            }
        };
        let (request, __idem_request) = match ::idem_runtime::__private::grpc::accept_keyed::<
            DB,
            Self,
            _,
        >(
            self,
            &__IDEM_POLICY,
            __idem_grpc,
            |__idem_message: &CreatePaymentRequest| ::idem_runtime::grpc::KeyField::key_field(
                &__idem_message.r#type,
            ),
        ) {
            ::core::result::Result::Ok(__idem_accepted) => __idem_accepted,
            ::core::result::Result::Err(__idem_status) => {
                return ::core::result::Result::Err(__idem_status);
            }
        };
        let __idem_span = __idem_request.span();
        ::idem_runtime::__private::Instrument::instrument(
                async move {
                    let __idem_scope = ::idem_runtime::__private::StoredScope::Caller(
                        ::std::borrow::Cow::into_owned(
                            ::idem_runtime::IdempotencyScope::idempotency_scope(&tenant),
                        ),
                    );
                    let __idem_options = __IDEM_POLICY.__options();
                    let mut __idem_attempt = ::idem_runtime::__private::Attempt::from(
                        __idem_request,
                    );
                    loop {
                        let mut __idem_slot = ::core::option::Option::None;
                        #[allow(unused_mut)]
                        let mut __idem_claim = match ::idem_runtime::__private::Claim::<
                            DB,
                        >::acquire(
                                &mut __idem_slot,
                                __idem_attempt,
                                &__idem_scope,
                                __idem_options,
                            )
                            .await
                        {
                            ::idem_runtime::__private::Acquired::Claimed(
                                __idem_claim,
                            ) => __idem_claim,
                            ::idem_runtime::__private::Acquired::Again(__idem_again) => {
                                __idem_attempt = __idem_again;
                                continue;
                            }
                            ::idem_runtime::__private::Acquired::Answer(
                                __idem_answer,
                            ) => {
                                return ::idem_runtime::__private::grpc::answer(
                                        __idem_answer,
                                    )
                                    .await;
                            }
                        };
                        let __idem_into_response = |
                            __idem_output: Result<Response<Payment>, Status>,
                        | -> ::idem_runtime::__private::Response {
                            ::idem_runtime::__private::grpc::into_http(__idem_output)
                        };
                        let __idem_limit = __idem_claim.limit();
                        let __idem_output = {
                            let tx: &mut Transaction<'_, DB> = __idem_claim
                                .transaction();
                            ::idem_runtime::__private::run_until(
                                    __idem_limit,
                                    ::idem_runtime::__private::typed_body::<
                                        Result<Response<Payment>, Status>,
                                        _,
                                    >(async move {
                                        let payment = record(&tenant, tx, request.into_inner())
                                            .await?;
                                        Ok(Response::new(payment))
                                    }),
                                )
                                .await
                        };
                        let __idem_response = match __idem_output {
                            ::core::option::Option::Some(__idem_value) => {
                                __idem_into_response(__idem_value)
                            }
                            ::core::option::Option::None => {
                                return ::idem_runtime::__private::grpc::answer(
                                        __idem_claim.stopped(__idem_limit).await,
                                    )
                                    .await;
                            }
                        };
                        return ::idem_runtime::__private::grpc::answer(
                                __idem_claim.complete(__idem_response).await,
                            )
                            .await;
                    }
                },
                __idem_span,
            )
            .await
    }
}
